"""The diagnosis' pure rules: error signatures, fact-supplying corrections, schema checks, drift, rules."""

from __future__ import annotations

from collections import Counter

import pytest

from proxy.evolve.rules import Rules, RulesError, load_rules, rules_from_mapping
from proxy.evolve.signals import (
    argument_violations,
    error_signature,
    length_bucket,
    psi,
    result_text,
    supplies_facts,
    tool_schemas,
    total_variation,
)


def test_error_signatures_cluster_what_varies():
    a = error_signature("Permission denied: /srv/app-1/release.tar\n  at deploy.py:12")
    b = error_signature("permission denied: /srv/app-22/other.tar")
    assert a == b == "permission denied: <path>"
    assert error_signature("3 tests failed in tests/unit") == "<n> tests failed in <path>"
    assert error_signature('KeyError: "user_id" (request 0d1f2e3c-aaaa-bbbb-cccc-111122223333)') == \
        "keyerror: <str> (request <id>)"
    assert error_signature("fetch https://x.example/a?b=1 failed: 503") == "fetch <url> failed: <n>"
    assert error_signature("  \n") == "<empty>"


def test_result_text_reads_every_api_shape():
    assert result_text({"type": "tool_result", "content": [{"type": "text", "text": "boom"}]}) == "boom"
    assert result_text({"role": "tool", "tool_call_id": "c1", "content": "no such file"}) == "no such file"
    assert result_text({"type": "function_call_output", "output": "timeout"}) == "timeout"


def test_corrections_that_supply_facts_differ_from_behaviour_requests():
    assert supplies_facts("The Berlin office is at 12 Hauptstrasse")
    assert supplies_facts("Our VPN port is 8443")
    assert not supplies_facts("Don't be so verbose, keep it shorter")
    assert not supplies_facts("wrong")


def test_arguments_are_checked_against_the_declared_schema():
    chat = [{"type": "function", "function": {"name": "deploy", "parameters": {
        "type": "object", "properties": {"env": {"enum": ["staging", "prod"]}}, "required": ["env"]}}}]
    anthropic = [{"name": "read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    schemas = tool_schemas(chat) | tool_schemas(anthropic) | tool_schemas([{"type": "function", "name": "r",
                                                                           "parameters": {"type": "object"}}])
    assert set(schemas) == {"deploy", "read", "r"}
    assert argument_violations('{"ref": "v1"}', schemas["deploy"]) == [("$.env", "required")]
    assert argument_violations('{"env": "dev"}', schemas["deploy"]) == [("$.env", "enum")]
    assert argument_violations('{"env": "prod"}', schemas["deploy"]) == []
    assert argument_violations('{"path": 3}', schemas["read"]) == [("$.path", "type")]
    assert argument_violations("{not json", schemas["read"]) == [("$", "arguments are not valid JSON")]
    assert argument_violations("{}", {"type": "no-such-type"}) == []  # a broken schema checks nothing


def test_drift_measures():
    same = Counter(a=50, b=50)
    assert psi(same, Counter(a=5, b=5)) == pytest.approx(0.0)
    assert total_variation(same, Counter(a=100)) == pytest.approx(0.5)
    shifted = psi(same, Counter(a=90, b=10))
    assert shifted > 0.2 and psi(same, Counter(a=55, b=45)) < 0.1
    assert psi(Counter(), same) == 0.0
    assert [length_bucket(n) for n in (10, 64, 127, 128, 1000)] == ["<64", "64-127", "64-127", "128-255", "512-1023"]


def test_rules_are_checked(tmp_path):
    assert load_rules(None) == Rules()
    f = tmp_path / "r.toml"
    f.write_text("[diagnosis]\nmin_failures = 5\nconcentration_share = 0.7\n")
    r = load_rules(f)
    assert r.min_failures == 5 and r.concentration_share == 0.7 and r.fact_share == Rules().fact_share
    for bad in ({"nope": 1}, {"min_failures": 1.5}, {"fact_share": 1.5}, {"min_failures": True}, {"drift_psi": -1}):
        with pytest.raises(RulesError):
            rules_from_mapping(bad)
    f.write_text("min_failures = [\n")
    with pytest.raises(RulesError, match="cannot read"):
        load_rules(f)
