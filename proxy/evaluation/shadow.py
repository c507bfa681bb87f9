"""The shadow gate's pure parts: is a mirrored answer sound, and does the candidate's arm hold up.

A mirrored live call is answered twice off the request path, as it was served and with the candidate in
place of its layer's serving version (proxy.rollout.layer_shadow). Live calls have no expected answer,
so each answer is judged on what any answer must be: an answer at all (no error status), tool calls that
name a tool the request declared with arguments its schema accepts, not cut at the token limit. Such an
answer scores 1, else 0; the two arms are compared as the replay gate compares them (proxy.evaluation.
stats: the paired bootstrap interval), and the candidate fails when it is shown worse (the interval's
upper bound below 0).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.evaluation.cases import Answer
from proxy.evaluation.stats import Pair, compare
from proxy.evolve.signals import JsonValue, argument_violations


@dataclass(frozen=True)
class Arm:
    """One arm's answer to a mirrored call: the answer, or the status the upstream refused it with."""

    answer: Answer | None
    status: int = 200


@dataclass(frozen=True)
class Mirrored:
    serving: list[str]  # the serving arm's problems (empty: a sound answer)
    candidate: list[str]
    agree: bool  # the same text and the same tool calls


def declared_schemas(tools: object) -> dict[str, Mapping[str, JsonValue]]:
    """Tool name -> its parameters' JSON schema, from a chat-completions `tools` list."""
    out: dict[str, Mapping[str, JsonValue]] = {}
    for tool in tools if isinstance(tools, list) else []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


# A problem names a tool and an argument path only when they are identifiers: the gate's numbers are
# written to the database unredacted, and a model may put anything (an address, a name) where a key or a
# tool name belongs. OpenAI's function names have this shape; any other path is shown as "?".
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PATH = re.compile(r"\$(\.[A-Za-z0-9_-]{1,64}|\[\d+\])*")


def _shown(path: str) -> str:
    return path if _PATH.fullmatch(path) else "?"


def problems(arm: Arm, schemas: Mapping[str, Mapping[str, JsonValue]]) -> list[str]:
    """What is wrong with one arm's answer ([]: nothing). Never a value the model wrote (see `_PATH`)."""
    if arm.answer is None:
        return [f"answered {arm.status}"]
    out = []
    for call in arm.answer.tool_calls:
        name = call.get("name")
        if not isinstance(name, str) or name not in schemas:
            out.append("called a tool the request did not declare")
            continue
        for path, problem in argument_violations(call.get("arguments") or "", schemas[name]):
            out.append(f"{name if _NAME.fullmatch(name) else '?'}.{_shown(path)}: {problem}")
    if arm.answer.finish_reason == "length":
        out.append("cut at max_tokens")
    return out


def mirrored(serving: Arm, candidate: Arm, tools: object) -> Mirrored:
    schemas = declared_schemas(tools)
    a, b = serving.answer, candidate.answer
    agree = a is not None and b is not None and a.text == b.text and a.tool_calls == b.tool_calls
    return Mirrored(problems(serving, schemas), problems(candidate, schemas), agree)


@dataclass
class ShadowNumbers:
    """What the gate has seen so far, as its row's numbers."""

    wanted: int
    results: list[Mirrored] = field(default_factory=list)
    unchanged: int = 0  # live calls the candidate would not have changed (nothing to mirror)
    dropped: int = 0  # mirrors the upstream could not answer (5xx, unreachable): neither arm's doing

    def as_numbers(self, *, interval: bool = True) -> dict[str, object]:
        """`interval=False`: the counts only (progress while it runs; the bootstrap is left for the end)."""
        n = len(self.results)
        numbers: dict[str, object] = {"mirrored": n, "wanted": self.wanted, "unchanged": self.unchanged,
                                      "dropped": self.dropped}
        if n and interval:
            numbers["overall"] = compare([Pair("all", float(not r.candidate), float(not r.serving))
                                          for r in self.results]).as_dict()
        if n:
            numbers["agree"] = round(sum(r.agree for r in self.results) / n, 4)
            for arm in ("serving", "candidate"):
                seen = Counter(p for r in self.results for p in getattr(r, arm))
                numbers[f"{arm}_problems"] = dict(seen.most_common(5))
        return numbers


def verdict(numbers: ShadowNumbers) -> tuple[bool, list[str]]:
    """(passed, reasons): the candidate fails when it is shown worse, or when too few calls were mirrored."""
    n = len(numbers.results)
    if n < numbers.wanted:
        return False, [f"shadow: {n} of {numbers.wanted} live calls mirrored before the wait ended"]
    o = compare([Pair("all", float(not r.candidate), float(not r.serving)) for r in numbers.results])
    if o.ci_high < 0:
        return False, [f"shadow: sound answers {o.candidate_mean:.3f} with the candidate against {o.serving_mean:.3f} "
                       f"as served, difference {o.diff_mean:+.3f} [{o.ci_low:+.3f}, {o.ci_high:+.3f}]"]
    return True, []

