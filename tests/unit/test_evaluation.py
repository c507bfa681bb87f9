"""The replay gate's pure parts: evaluators, suite files, the held-out bucket, the paired statistics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from proxy.evaluation.cases import Answer, EvalCase, SuiteError, load_suites
from proxy.evaluation.evaluators import EvaluatorError, Registry
from proxy.evaluation.stats import Pair, bootstrap_interval, compare, decide
from proxy.store.holdout import bucket, held_out

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def _case(evaluator: str, expected, **request) -> EvalCase:
    return EvalCase(id="c1", tenant="acme", source="suite:t.jsonl",
                    request={"messages": [{"role": "user", "content": "q"}], **request},
                    evaluator=evaluator, expected=expected)


def upper_scorer(case: EvalCase, answer: Answer) -> float:
    """A `module:function` evaluator: 1 when the answer is all upper case."""
    return float(answer.text.isupper())


def test_built_in_evaluators_score_answers():
    r = Registry()
    assert r.score(_case("exact", " 19 "), Answer("19\n")) == 1.0
    assert r.score(_case("exact", "19"), Answer("12 + 7 = 19")) == 0.0
    assert r.score(_case("regex", r"\b19\b"), Answer("12 + 7 = 19")) == 1.0
    assert r.score(_case("regex", r"^\d+$"), Answer("nineteen")) == 0.0
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert r.score(_case("json-schema", schema), Answer('{"n": 3}')) == 1.0
    assert r.score(_case("json-schema", schema), Answer('{"n": "3"}')) == 0.0
    assert r.score(_case("json-schema", schema), Answer("not json")) == 0.0


def test_tool_call_valid_checks_name_and_arguments_against_the_offered_schema():
    r = Registry()
    good = Answer("", [{"name": "add", "arguments": '{"a": 1, "b": 2}'}])
    assert r.score(_case("tool-call-valid", None, tools=TOOLS), good) == 1.0
    assert r.score(_case("tool-call-valid", "add", tools=TOOLS), good) == 1.0
    assert r.score(_case("tool-call-valid", "sub", tools=TOOLS), good) == 0.0  # not the tool required
    bad_args = Answer("", [{"name": "add", "arguments": '{"a": "one"}'}])
    assert r.score(_case("tool-call-valid", None, tools=TOOLS), bad_args) == 0.0
    unknown = Answer("", [{"name": "rm", "arguments": "{}"}])
    assert r.score(_case("tool-call-valid", None, tools=TOOLS), unknown) == 0.0
    assert r.score(_case("tool-call-valid", None, tools=TOOLS), Answer("I would add them")) == 0.0


def test_recorded_scores_an_answer_against_the_rewarded_recorded_one():
    r = Registry()
    call = {"text": "", "tools": ["add"]}
    good = Answer("", [{"name": "add", "arguments": '{"a": 1, "b": 2}'}])
    assert r.score(_case("recorded", call, tools=TOOLS), good) == 1.0
    assert r.score(_case("recorded", call, tools=TOOLS), Answer("", [{"name": "add", "arguments": '{"a": "x"}'}])) == 0.0
    assert r.score(_case("recorded", call, tools=TOOLS), Answer("", good.tool_calls * 2)) == 0.0  # not the same calls
    assert r.score(_case("recorded", call, tools=TOOLS), Answer("3")) == 0.0
    said = {"text": "the answer is 19", "tools": []}
    assert r.score(_case("recorded", said), Answer("the answer is 19")) == 1.0
    assert r.score(_case("recorded", said), Answer("the answer is 12")) == 0.75  # 3 of 4 words
    assert r.score(_case("recorded", said), Answer("", good.tool_calls)) == 0.0  # a call where words were rewarded
    with pytest.raises(EvaluatorError):
        r.score(_case("recorded", "19"), Answer("19"))


def test_command_evaluator_reads_the_case_on_stdin_and_prints_a_score(tmp_path: Path):
    program = tmp_path / "score.py"
    program.write_text("import json, sys\nd = json.load(sys.stdin)\n"
                       "print(1.0 if d['answer']['text'] == d['case']['expected'] else 0.25)\n")
    r = Registry()
    assert r.score(_case("command", [sys.executable, str(program)]), Answer("yes")) == 0.25  # expected is the argv
    case = EvalCase(id="c2", tenant="acme", source="s", request={"messages": []}, evaluator="command",
                    expected=[sys.executable, "-c", "import json,sys; d=json.load(sys.stdin); "
                              "print(float(d['answer']['text'] == 'ok'))"])
    assert r.score(case, Answer("ok")) == 1.0
    failing = _case("command", [sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(EvaluatorError, match="exited 3"):
        r.score(failing, Answer("x"))
    out_of_range = _case("command", [sys.executable, "-c", "print(7)"])
    with pytest.raises(EvaluatorError, match="not in"):
        r.score(out_of_range, Answer("x"))


def test_evaluators_resolve_by_module_path_and_unknown_names_fail():
    r = Registry()
    assert r.score(_case("tests.unit.test_evaluation:upper_scorer", None), Answer("OK")) == 1.0
    with pytest.raises(EvaluatorError, match="unknown evaluator"):
        r.score(_case("no-such-evaluator", None), Answer("x"))
    with pytest.raises(EvaluatorError, match="ModuleNotFoundError"):
        r.score(_case("no_such_module:fn", None), Answer("x"))
    with pytest.raises(EvaluatorError, match="needs a string"):
        r.score(_case("exact", {"not": "a string"}), Answer("x"))


def test_suites_hold_cases_and_task_rules(tmp_path: Path):
    (tmp_path / "acme.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"messages": [{"role": "user", "content": "12 + 7?"}], "evaluator": "regex", "expected": "19"},
        {"id": "g1", "tenant": "globex", "messages": [{"role": "user", "content": "hi"}], "evaluator": "exact",
         "expected": "hello", "max_tokens": 5},
        {"task": "arith", "evaluator": "regex", "expected": r"^\d+$"},
    ]) + "\n\n")
    (tmp_path / "notes.txt").write_text("ignored: not a .jsonl file")
    s = load_suites(tmp_path, max_tokens=64)
    assert [(c.id, c.tenant, c.request["max_tokens"]) for c in s.cases] == [("acme.jsonl:1", "acme", 64),
                                                                            ("g1", "globex", 5)]
    assert s.rules["arith"].evaluator == "regex"
    assert load_suites(None, max_tokens=8).cases == [] and load_suites(tmp_path / "missing", max_tokens=8).cases == []
    (tmp_path / "bad.jsonl").write_text('{"evaluator": "exact"}\n')
    with pytest.raises(SuiteError, match=r"bad.jsonl:1: neither a case"):
        load_suites(tmp_path, max_tokens=8)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SuiteError, match="not JSON"):
        load_suites(tmp_path, max_tokens=8)


def test_held_out_bucket_is_deterministic_and_near_its_share():
    ids = [f"session-{i}" for i in range(4000)]
    assert [bucket("acme", "t", i) for i in ids[:50]] == [bucket("acme", "t", i) for i in ids[:50]]
    share = sum(held_out("acme", "t", i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert not any(held_out("acme", "t", i, 0.0) for i in ids)
    # the split is per tenant and task: the same session id falls elsewhere under another task
    assert [held_out("acme", "t", i, 0.1) for i in ids] != [held_out("acme", "u", i, 0.1) for i in ids]


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    diffs = [0.0, 0.0, -1.0, 0.0, 1.0, -1.0, 0.0, 0.0, -1.0, 0.0]
    a, b = bootstrap_interval(diffs), bootstrap_interval(diffs)
    assert a == b  # fixed seed: the same scores give the same interval
    low, high = a
    assert low < sum(diffs) / len(diffs) < high and low >= -1.0 and high <= 1.0
    assert bootstrap_interval([0.0] * 5) == (0.0, 0.0)


def test_decide_applies_each_tenants_margin_and_the_overall_rule():
    same = [Pair("acme", 1.0, 1.0)] * 6 + [Pair("globex", 0.0, 0.0)] * 6
    v = decide(same, {"acme": 0.05, "globex": 0.05})
    assert v.passed and v.overall.diff_mean == 0.0 and set(v.tenants) == {"acme", "globex"}

    # globex regresses on every case: its interval is [-1, -1]; acme is unchanged.
    worse = [Pair("acme", 1.0, 1.0)] * 6 + [Pair("globex", 0.0, 1.0)] * 6
    v = decide(worse, {"acme": 0.05, "globex": 0.05})
    assert not v.passed and v.tenants["globex"].ci_low == -1.0
    assert any(r.startswith("tenant globex") for r in v.reasons) and any(r.startswith("overall") for r in v.reasons)

    # A tenant allowed a large regression passes when its interval stays above -max_regression.
    mixed = [Pair("acme", 1.0, 1.0)] * 9 + [Pair("acme", 0.0, 1.0)] + [Pair("acme", 1.0, 0.0)]
    assert decide(mixed, {"acme": 0.5}).passed
    c = compare(mixed)
    assert c.n == 11 and c.candidate_mean == pytest.approx(10 / 11) and c.serving_mean == pytest.approx(10 / 11)


def test_an_evaluator_registered_as_an_entry_point_is_found_by_name(tmp_path: Path, monkeypatch):
    # A distribution on sys.path, as `pip install` would leave it, declaring one `atdp.evaluators` plugin.
    (tmp_path / "my_scoring.py").write_text("def short(case, answer):\n    return float(len(answer.text) <= 5)\n")
    info = tmp_path / "my_scoring-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-scoring\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[atdp.evaluators]\nshort-answer = my_scoring:short\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = Registry()
    assert r.score(_case("short-answer", None), Answer("yes")) == 1.0
    assert r.score(_case("short-answer", None), Answer("a long answer")) == 0.0
