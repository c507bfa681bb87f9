"""The safety gate's pure part (proxy/evaluation/safety.py) with the real redaction engine, and the
policy fields it reads."""

from __future__ import annotations

import json

import pytest

from proxy.evaluation.cases import Answer, EvalCase
from proxy.evaluation.safety import judge
from proxy.governance.policy import PolicyError, TenantPolicy
from proxy.governance.redaction import RedactionConfig, Redactor

KEY = "AKIAQ7ZP4XWJ2M5N8K3D"


@pytest.fixture(scope="module")
def detector() -> Redactor:
    return Redactor(RedactionConfig(salt=b"test-salt"))


def _cases(*tenants: str) -> list[EvalCase]:
    return [EvalCase(id=f"c{i}", tenant=tenant, source="suite:t.jsonl", request={"messages": []}, evaluator="exact",
                     expected="x") for i, tenant in enumerate(tenants)]


def test_secrets_and_pii_are_counted_per_tenant_and_the_evidence_is_redacted(detector):
    cases = _cases("acme", "acme", "globex")
    serving = [Answer("the sum is 19"), Answer("call me"), Answer("write to ops@example.com")]
    candidate = [Answer(f"the sum is 19, key {KEY}"), Answer("call me"),
                 Answer("", tool_calls=[{"name": "mail", "arguments": json.dumps({"to": "ops@example.com"})}])]
    v = judge(cases, serving, candidate, policy_of=lambda _: TenantPolicy(), detector=detector)
    tenants = v.numbers["tenants"]
    assert tenants["acme"]["candidate"]["entities"] == {"AWS_ACCESS_KEY": 1} and not tenants["acme"]["passed"]
    # the same e-mail address in a tool call's arguments as in the serving version's text: no worse
    assert tenants["globex"]["candidate"]["pii"] == tenants["globex"]["serving"]["pii"] == 1
    assert tenants["globex"]["passed"]
    assert not v.passed and len(v.reasons) == 1 and "tenant acme" in v.reasons[0] and "AWS_ACCESS_KEY 1" in v.reasons[0]
    (evidence,) = v.numbers["violations"]
    assert evidence["worse"] == ["secrets"] and KEY not in json.dumps(v.numbers)
    assert "<AWS_ACCESS_KEY>" in evidence["candidate"]


def test_rules_compare_with_the_serving_version(detector):
    policy = TenantPolicy(forbidden_patterns=("(?i)acme-internal",), max_refusal_rate=0.25)
    cases = _cases("acme", "acme", "acme", "acme")
    # The serving version already says the forbidden word once and refuses twice.
    serving = [Answer("see acme-internal docs"), Answer("I cannot help with that"), Answer("I can't help"), Answer("ok")]
    same_or_better = [Answer("see ACME-INTERNAL docs"), Answer("I cannot help with that"), Answer("sure"), Answer("ok")]
    v = judge(cases, serving, same_or_better, policy_of=lambda _: policy, detector=detector)
    # refusal rate 0.25 (within the bound), forbidden 1 = serving's 1: an improvement is not blocked
    assert v.passed, v.reasons
    assert v.numbers["overall"]["candidate"]["refusal_rate"] == 0.25
    worse = [Answer("see acme-internal docs"), Answer("I cannot help with that"), Answer("I can't help"),
             Answer("I'm sorry, but I can't do that. acme-internal")]
    v = judge(cases, serving, worse, policy_of=lambda _: policy, detector=detector)
    assert not v.passed
    assert [r.split(": ", 1)[1][:20] for r in v.reasons] == ["2 of the candidate's", "refusal rate 0.750 a"]


def test_refusals_are_reported_not_bounded_by_default(detector):
    cases = _cases("acme", "acme")
    v = judge(cases, [Answer("ok"), Answer("ok")], [Answer("I cannot assist with that"), Answer("I won't comply")],
              policy_of=lambda _: TenantPolicy(), detector=detector)
    assert v.passed and v.numbers["tenants"]["acme"]["candidate"]["refusals"] == 2
    assert v.numbers["tenants"]["acme"]["max_refusal_rate"] is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"forbidden_patterns": ["(unclosed"]}, "not a valid regular expression"),
    ({"forbidden_patterns": "one string"}, "must be a list"),
    ({"refusal_patterns": [3]}, "must be a list"),
    ({"max_refusal_rate": 1.5}, "max_refusal_rate"),
    ({"max_refusal_rate": True}, "max_refusal_rate"),
])
def test_bad_safety_fields_are_policy_errors(fields, message):
    with pytest.raises(PolicyError, match=message):
        TenantPolicy.from_dict(fields)


def test_safety_fields_round_trip_through_a_dict():
    p = TenantPolicy.from_dict({"forbidden_patterns": ["a+"], "max_refusal_rate": 0.1})
    assert p.forbidden_patterns == ("a+",) and p.max_refusal_rate == 0.1
    again = TenantPolicy.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p and TenantPolicy().forbidden_patterns == () and TenantPolicy().max_refusal_rate is None
