"""Token ids as stored: per-token versions run-length encoded, prompts stored as the suffix after the
parent's prompt + output (`prompt_prefix_len`), and rebuilt from that prefix chain."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.orm import Session

from atdp_schema.models import TokenSource
from proxy.store import tables as t

# The token sources whose ids are kept and trainable: engine-exact, or re-derived from redacted text.
TRAINABLE_SOURCES: tuple[str, ...] = (TokenSource.engine, TokenSource.rederived)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids two sequences share (lists or `array('i')`, in any mix)."""
    # Compare as machine-int arrays: slices of two arrays compare in C, while an array never equals a
    # list (the writer's cache and the captured prompts hold arrays; replay's sequences are lists).
    x = a if isinstance(a, array) else array("i", a)
    y = b if isinstance(b, array) else array("i", b)
    n = min(len(x), len(y))
    if x[:n] == y[:n]:  # the usual case: the parent's sequence is a prefix of the prompt
        return n
    lo, hi = 0, n  # x[:lo] == y[:lo], x[:hi] != y[:hi]: bisect on the first mismatch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def ambiguous_version(before: str, after: str) -> str:
    """The per-token version label of a token sampled by `before` or `after`, the proxy cannot tell
    which (a keep-mode swap overlapped its call, no engine spans): never a version's own name."""
    return f"{before}|{after}"


def step_versions(n: int, *, engine: list[str] | None, window: tuple[str, str] | None, served: str | None
                  ) -> list[str]:
    """Each of a step's `n` output tokens' weight version: the engine's report when it made one;
    else, when a keep-mode swap overlapped the call, a label naming both sides (the step is then not
    eligible: proxy.governance.policy); else the version the call was served under."""
    if engine is not None and len(engine) == n:
        return list(engine)
    if window is not None:
        return [ambiguous_version(*window)] * n
    return [served or "unknown"] * n


def rle(values: list[str]) -> list[list[Any]]:
    """Run-length encode per-token versions: ["a","a","b"] -> [["a", 2], ["b", 1]]."""
    if values and values.count(values[0]) == len(values):  # the usual case: one version (C-speed count)
        return [[values[0], len(values)]]
    runs: list[list[Any]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def unrle(runs: list[list[Any]]) -> list[str]:
    return [v for v, n in runs for _ in range(n)]


def rebuild_prompt_ids(steps: dict[str, t.Step], fetch: Callable[[str, str], t.Step | None] | None = None
                       ) -> dict[str, list[int]]:
    """Full prompt ids of each step, from stored suffixes plus ancestors' prompt+output ids.
    `fetch(parent_id, child's session_id)` reads an ancestor not in `steps` (`tables.get_step`)."""
    memo: dict[str, list[int]] = {}

    def full(step: t.Step) -> list[int]:
        if step.id in memo:
            return memo[step.id]
        ids = list(step.prompt_token_ids)
        if step.prompt_prefix_len and step.parent_step_id:
            parent = steps.get(step.parent_step_id) or (fetch(step.parent_step_id, step.session_id) if fetch else None)
            if parent is None:
                raise LookupError(f"step {step.id}: parent {step.parent_step_id} missing, prefix lost")
            ids = (full(parent) + list(parent.output_token_ids))[: step.prompt_prefix_len] + ids
        memo[step.id] = ids
        return ids

    return {sid: full(st) for sid, st in steps.items()}


def full_prompt_ids(s: Session, step: t.Step) -> list[int]:
    """One step's full prompt ids (its ancestors fetched as needed)."""
    return rebuild_prompt_ids({step.id: step}, fetch=lambda i, sid: t.get_step(s, i, sid))[step.id]


def per_token_versions(st: t.Step) -> list[str]:
    return unrle(st.output_versions)
