"""The pure parts of harness and memory versions: overlays, merging, memory's query and injection,
and the constraint sentences a proposal writes."""

from __future__ import annotations

import pytest

from proxy.evolve.proposals import constraint_text
from proxy.layers.memory import HEADER, query_terms, question_text, with_facts
from proxy.layers.overlay import OverlayError, apply_harness, merge_overlays, parse_overlay

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]


def test_the_overlay_changes_a_new_body_and_leaves_the_clients_alone():
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "tools": TOOLS, "stop": "###"}
    o = parse_overlay({"system_append": "Cite files.", "stop": ["<END>"], "tools": {"get_weather": {
        "description_append": "Check the unit.", "properties": {"unit": {"description": "c or f."}}}}})
    out = apply_harness(body, o)
    assert out["messages"][0] == {"role": "system", "content": "Be brief.\n\nCite files."}
    fn = out["tools"][0]["function"]
    assert fn["description"] == "Weather. Check the unit."
    assert fn["parameters"]["properties"]["unit"] == {"type": "string", "enum": ["c", "f"], "description": "c or f."}
    assert out["tools"][1] is TOOLS[1] and out["stop"] == ["###", "<END>"]
    assert body["messages"][0]["content"] == "Be brief." and TOOLS[0]["function"]["description"] == "Weather."


def test_a_system_addition_without_a_system_message_becomes_one_and_parts_get_a_part():
    o = parse_overlay({"system_append": "X"})
    assert apply_harness({"messages": [{"role": "user", "content": "q"}]}, o)["messages"][0] == {
        "role": "system", "content": "X"}
    parts = apply_harness({"messages": [{"role": "system", "content": [{"type": "text", "text": "A"}]}]}, o)
    assert parts["messages"][0]["content"] == [{"type": "text", "text": "A"}, {"type": "text", "text": "X"}]


@pytest.mark.parametrize("spec, field", [
    ([], "overlay"), ({}, "changes nothing"), ({"prompt": "x"}, "unknown field 'prompt'"),
    ({"system_append": ""}, "overlay.system_append"), ({"tools": {"t": {}}}, "overlay.tools.t"),
    ({"tools": {"t": {"parameters": {"type": "array"}}}}, "overlay.tools.t.parameters"),
    ({"tools": {"t": {"properties": {"a": {}}}}}, "overlay.tools.t.properties"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "overlay.stop"), ({"system_append": "x" * 9000}, "at most"),
])
def test_a_bad_overlay_is_refused_naming_its_field(spec, field):
    with pytest.raises(OverlayError, match=field.replace(".", r"\.").replace("(", r"\(")):
        parse_overlay(spec)


def test_a_proposal_adds_to_the_serving_overlay():
    base = {"system_append": "A", "tools": {"t": {"description": "d", "properties": {"x": {"enum": [1]}}}}}
    new = {"tools": {"t": {"properties": {"y": {"description": "y!"}}}, "u": {"description_append": "u!"}}}
    merged = merge_overlays(base, new)
    assert merged == {"system_append": "A", "tools": {"t": {"description": "d", "properties": {
        "x": {"enum": [1]}, "y": {"description": "y!"}}}, "u": {"description_append": "u!"}}}
    assert merge_overlays(None, new) == new


def test_memory_searches_user_questions_only_with_safe_terms():
    assert question_text({"messages": [{"role": "user", "content": "Which port?"}]}) == "Which port?"
    assert question_text({"messages": [{"role": "tool", "content": "42"}]}) is None
    assert question_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "image_url"}]}]}) == "a"
    terms = query_terms("What's the port of billing-api? (v2.1) & | ! 'x' port")
    assert terms == ["what", "the", "port", "of", "billing", "api", "v2"]
    assert all(t.isalnum() for t in terms)


def test_facts_go_in_front_of_the_question():
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]}
    out = with_facts(body, ["F1", "F2"])
    assert out["messages"][-1]["content"] == f"{HEADER}\n- F1\n- F2\n\nQ?"
    assert out["messages"][0] is body["messages"][0] and body["messages"][-1]["content"] == "Q?"
    assert with_facts(body, []) is body


@pytest.mark.parametrize("problem, schema, sentence", [
    ("enum", {"enum": ["c", "f"]}, 'Must be exactly one of: "c", "f".'),
    ("type", {"type": "integer"}, "Must be a JSON integer."),
    ("required", {}, "Required: always pass this argument."),
    ("pattern", {"pattern": "^[a-z]+$"}, "Must match the regular expression ^[a-z]+$."),
    ("maximum", {"maximum": 10}, "Must be <= 10."),
    ("minLength", {"minLength": 3}, "minLength: 3."),
    ("const", {"const": 1}, "Must satisfy the schema's `const` (1)."),
])
def test_a_proposal_spells_out_the_violated_constraint(problem, schema, sentence):
    assert constraint_text(problem, schema) == sentence
