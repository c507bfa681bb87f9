"""Long strings stored once: a message or output body refers to its long texts by content hash.

A tool result is sent twice (its own content and inside the tool message), a model's text three
times (the action's `text`, the native message in `output`, the assistant message the agent echoes
next turn): the same string in different envelopes, so content addressing of whole values missed
it. Bodies of ENCODED_KINDS keep each string of MIN_CHARS or more as a reference, `MARK + "@" +
hash`, to a `contents` row whose body is that string (kind `text`; a tool result or system prompt
that is that string already is that row: same keyed hash), and an output's native message as a
reference to a `message` row (the echo of it next turn, when it is the same, is that row). U+E000 (a private-use character) starts
every reference; a stored string that starts with it is escaped by one more, so any body decodes
exactly. SQL readers use `atdp_content(tenant, kind, body)` (migration 0013), the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

MARK = "\ue000"
REF = MARK + "@"
MIN_CHARS = 256  # below this a reference (68 bytes) and its row cost about what they save
ENCODED_KINDS = frozenset({"message", "output"})


def escape(value: Any) -> Any:
    """`value` with every string that starts with MARK escaped (no references made)."""
    return encode(value, None)[0]


def encode(value: Any, key: Callable[[Any], tuple[str, int]] | None, kind: str = "message"
           ) -> tuple[Any, dict[str, tuple[str, Any, int]]]:
    """(stored form, {hash: (kind, stored body, size)} of the rows it refers to). `key` gives a value's
    hash and the bytes of its canonical JSON (None: escape only). A top-level string is never
    replaced: a body that is one string is itself a text row. An output's native message (`output`,
    the assistant turn the agent echoes next call) is a `message` row of its own, so the echo is the
    same row."""
    rows: dict[str, tuple[str, Any, int]] = {}

    def walk(v: Any, top: bool) -> Any:
        if isinstance(v, str):
            if v.startswith(MARK):
                return MARK + v
            if key is not None and not top and len(v) >= MIN_CHARS:
                h, size = key(v)
                rows[h] = ("text", v, size)
                return REF + h
            return v
        if isinstance(v, dict):
            return {k: walk(x, False) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, False) for x in v]
        return v

    if key is not None and kind == "output" and isinstance(value, dict) and isinstance(value.get("output"), dict):
        native = value["output"]
        h, size = key(native)
        rows[h] = ("message", walk(native, False), size)
        return {k: (REF + h if k == "output" else walk(x, False)) for k, x in value.items()}, rows
    return walk(value, True), rows


def refs(value: Any) -> set[str]:
    """The hashes a stored body refers to."""
    out: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, str):
            if v.startswith(REF):
                out.add(v[len(REF):])
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(value)
    return out


def decode(value: Any, lookup: Callable[[str], Any]) -> Any:
    """A stored body back as it was written; `lookup(hash)` gives a referred row's body, read back
    (None when it is gone)."""
    if isinstance(value, str):
        if not value.startswith(MARK):
            return value
        return lookup(value[len(REF):]) if value.startswith(REF) else value[1:]
    if isinstance(value, dict):
        return {k: decode(x, lookup) for k, x in value.items()}
    if isinstance(value, list):
        return [decode(x, lookup) for x in value]
    return value


def all_refs(bodies: Iterable[Any]) -> set[str]:
    out: set[str] = set()
    for b in bodies:
        out |= refs(b)
    return out
