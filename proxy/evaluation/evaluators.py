"""Evaluators: name -> function scoring one replayed answer of one case, in [0, 1].

Resolution of a name, in order: the built-ins below; a plugin registered under the entry-point group
`atdp.evaluators` (`name = "package.module:function"`); a `module:function` path. Every evaluator
has the signature `(case: EvalCase, answer: Answer) -> float`.

Built-ins (`expected` is the case's expected outcome):
- `exact`: the answer's text, stripped, equals `expected` (a string).
- `regex`: `expected` (a Python regular expression) matches somewhere in the text.
- `json-schema`: the text is JSON valid against `expected` (a JSON Schema).
- `tool-call-valid`: the answer makes at least one tool call, each names a tool the case offers and
  its arguments are JSON valid against that tool's `parameters` schema; `expected`, when a string,
  is the tool that must be called.
- `recorded` (held-out sessions without a task rule): `expected` is `{"text", "tools"}`, a rewarded
  recorded answer. With tools: 1 when the answer calls the same tools (as a multiset) with arguments
  valid against their schemas, else 0. Without: the word-level similarity of the answer's text to the
  recorded text (difflib's ratio, 0..1), 0 when the answer calls a tool instead.
- `command`: `expected` is an argv list (or a string split on spaces); the program reads the case
  and the answer as one JSON object on stdin and prints a score (a number) on stdout.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import jsonschema

from proxy.evaluation.cases import Answer, EvalCase

Evaluator = Callable[[EvalCase, Answer], float]
ENTRY_POINT_GROUP = "atdp.evaluators"
COMMAND_TIMEOUT_S = 30.0


class EvaluatorError(ValueError):
    """An evaluator that cannot be found, or a case it cannot score."""


def exact(case: EvalCase, answer: Answer) -> float:
    if not isinstance(case.expected, str):
        raise EvaluatorError(f"case {case.id}: 'exact' needs a string 'expected'")
    return float(answer.text.strip() == case.expected.strip())


def regex(case: EvalCase, answer: Answer) -> float:
    if not isinstance(case.expected, str):
        raise EvaluatorError(f"case {case.id}: 'regex' needs a pattern in 'expected'")
    return float(re.search(case.expected, answer.text) is not None)


def json_schema(case: EvalCase, answer: Answer) -> float:
    if not isinstance(case.expected, dict):
        raise EvaluatorError(f"case {case.id}: 'json-schema' needs a schema object in 'expected'")
    try:
        jsonschema.validate(json.loads(answer.text), case.expected)
    except (ValueError, jsonschema.ValidationError):
        return 0.0
    return 1.0


def _offered(case: EvalCase) -> dict[str, dict]:
    """The case's tools by name: their parameters' JSON Schema."""
    offered = {}
    for tool in case.request.get("tools") or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            offered[fn["name"]] = fn.get("parameters") or {"type": "object"}
    return offered


def _calls_valid(calls: list[dict], offered: dict[str, dict]) -> bool:
    for call in calls:
        name = call.get("name")
        if name not in offered:
            return False
        try:
            jsonschema.validate(json.loads(call.get("arguments") or "{}"), offered[name])
        except (ValueError, jsonschema.ValidationError):
            return False
    return True


def tool_call_valid(case: EvalCase, answer: Answer) -> float:
    if not answer.tool_calls:
        return 0.0
    if isinstance(case.expected, str) and any(call.get("name") != case.expected for call in answer.tool_calls):
        return 0.0
    return float(_calls_valid(answer.tool_calls, _offered(case)))


def recorded(case: EvalCase, answer: Answer) -> float:
    expected = case.expected
    if not isinstance(expected, dict) or not isinstance(expected.get("text"), str) or not isinstance(
            expected.get("tools"), list):
        raise EvaluatorError(f"case {case.id}: 'recorded' needs {{'text': str, 'tools': [names]}} in 'expected'")
    if expected["tools"]:
        same = sorted(str(c.get("name")) for c in answer.tool_calls) == sorted(map(str, expected["tools"]))
        return float(same and _calls_valid(answer.tool_calls, _offered(case)))
    if answer.tool_calls:
        return 0.0
    return difflib.SequenceMatcher(None, answer.text.split(), expected["text"].split(), autojunk=False).ratio()


def command(case: EvalCase, answer: Answer) -> float:
    argv = shlex.split(case.expected) if isinstance(case.expected, str) else case.expected
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise EvaluatorError(f"case {case.id}: 'command' needs a program (argv list or string) in 'expected'")
    payload = json.dumps({"case": case.public(), "answer": {"text": answer.text, "tool_calls": answer.tool_calls,
                                                      "finish_reason": answer.finish_reason}})
    try:
        done = subprocess.run(argv, input=payload, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EvaluatorError(f"case {case.id}: command {argv[0]!r}: {type(e).__name__}: {e}") from None
    if done.returncode != 0:
        raise EvaluatorError(f"case {case.id}: command {argv[0]!r} exited {done.returncode}: {done.stderr[-300:]}")
    try:
        return float(done.stdout.strip().split()[-1])
    except (ValueError, IndexError):
        raise EvaluatorError(f"case {case.id}: command {argv[0]!r} printed no score: {done.stdout[-200:]!r}") from None


BUILT_INS: dict[str, Evaluator] = {
    "exact": exact, "regex": regex, "json-schema": json_schema, "tool-call-valid": tool_call_valid,
    "command": command, "recorded": recorded,
}


@dataclass
class Registry:
    """Resolved evaluators, cached by name (entry points and imports are looked up once)."""

    found: dict[str, Evaluator] = field(default_factory=lambda: dict(BUILT_INS))

    def get(self, name: str) -> Evaluator:
        if name not in self.found:
            self.found[name] = _resolve(name)
        return self.found[name]

    def score(self, case: EvalCase, answer: Answer) -> float:
        value = float(self.get(case.evaluator)(case, answer))
        if not 0.0 <= value <= 1.0:  # scores are compared across versions: keep one scale
            raise EvaluatorError(f"case {case.id}: evaluator {case.evaluator!r} returned {value}, not in [0, 1]")
        return value


def _resolve(name: str) -> Evaluator:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    if ":" in name:
        # The entry-point resolver reads a `module:function` path exactly as a plugin's metadata would.
        try:
            fn = EntryPoint(name=name, value=name, group=ENTRY_POINT_GROUP).load()
        except (ImportError, AttributeError) as e:
            raise EvaluatorError(f"evaluator {name!r}: {type(e).__name__}: {e}") from None
        if callable(fn):
            return fn
    raise EvaluatorError(f"unknown evaluator {name!r}: not a built-in {sorted(BUILT_INS)}, "
                         f"not an '{ENTRY_POINT_GROUP}' entry point, not a module:function path")
