"""proxy/store/texts.py: long strings and outputs' native messages by reference, and back exactly."""

from __future__ import annotations

import hashlib
from typing import Any

from proxy.store.content import canonical
from proxy.store.texts import MARK, MIN_CHARS, REF, decode, encode, escape, refs


def digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def key(value: Any) -> tuple[str, int]:
    return digest(value), len(canonical(value))


def round_trip(value: Any, kind: str = "message") -> tuple[Any, dict]:
    stored, rows = encode(value, key, kind)
    bodies = {h: body for h, (_, body, _) in rows.items()}

    def lookup(h: str) -> Any:
        return decode(bodies[h], lookup)

    assert decode(stored, lookup) == value
    return stored, rows


def test_long_strings_become_references_short_ones_stay() -> None:
    long = "x" * MIN_CHARS
    value = {"role": "tool", "content": long, "name": "short", "parts": [long, {"deep": long}]}
    stored, rows = round_trip(value)
    assert stored == {"role": "tool", "content": REF + digest(long), "name": "short",
                      "parts": [REF + digest(long), {"deep": REF + digest(long)}]}
    assert rows == {digest(long): ("text", long, MIN_CHARS + 2)}
    assert refs(stored) == {digest(long)}


def test_a_body_that_is_one_string_is_kept_whole() -> None:
    long = "y" * (MIN_CHARS * 2)
    assert round_trip(long) == (long, {})


def test_strings_starting_with_the_mark_are_escaped_not_read_as_references() -> None:
    value = {"a": MARK + "@" + "0" * 64, "b": MARK + "plain", "c": [MARK], MARK + "key": "v"}
    stored, rows = round_trip(value)
    assert rows == {} and refs(stored) == set()
    assert stored["a"] == MARK + MARK + "@" + "0" * 64 and stored["c"] == [MARK + MARK]
    assert escape(value) == stored
    assert decode(escape(MARK + "@x"), lambda h: "never") == MARK + "@x"


def test_an_outputs_native_message_is_a_message_row_of_its_own() -> None:
    thought = "z" * MIN_CHARS
    native = {"role": "assistant", "content": thought, "tool_calls": []}
    output = {"text": thought, "reasoning": None, "tool_calls": [], "output": native}
    stored, rows = round_trip(output, "output")
    assert stored == {"text": REF + digest(thought), "reasoning": None, "tool_calls": [], "output": REF + digest(native)}
    assert rows[digest(native)][:2] == ("message", {"role": "assistant", "content": REF + digest(thought), "tool_calls": []})
    assert rows[digest(thought)][0] == "text"


def test_a_reference_whose_row_is_gone_reads_as_none() -> None:
    assert decode({"content": REF + "f" * 64}, lambda h: None) == {"content": None}
