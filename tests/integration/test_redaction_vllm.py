"""Redaction on real agent traffic through the real proxy and the real tiny vLLM:
- a Claude-Code-shaped `/v1/messages` call carrying Claude Code's own system prompt text (model ids with
  dates, versions, paths) and tool schemas stays trainable: nothing redacted, eligible, engine token ids;
- vLLM's 400 errors echo the request; the stored error (steps row, the readable view) and the span
  carry no seeded value."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text

from proxy.telemetry import Tracer
from proxy.translate.anthropic import messages_to_chat
from tests.redaction_corpus import client_operator_content

EMAIL = "maria.gonzalez@fastmail.com"
PHONE = "+1 415-555-0132"
CARD = "4111 1111 1111 1111"


def claude_code_system_excerpt() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Claude Code's captured system blocks, the long one cut to its `# Environment` section (the part
    with the model ids and paths that redaction must leave alone; the whole prompt is ~9k tokens, which
    the shared engine serves but this test does not need), and its two smallest tool schemas."""
    content = client_operator_content()["claude-code"]
    blocks = content["system"]["system"]
    head, long = blocks[:2], blocks[2]
    start = long["text"].index("# Environment")
    end = long["text"].index("\n\n", long["text"].index("claude-haiku-4-5-20251001"))
    excerpt = {**long, "text": long["text"][start:end]}
    tools = sorted(content["tools"], key=lambda t: len(json.dumps(t)))[:2]
    return [*head, excerpt], tools


@pytest.mark.vllm
def test_claude_code_system_prompt_stays_trainable(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url])
    system, tools = claude_code_system_excerpt()
    assert "claude-haiku-4-5-20251001" in system[2]["text"]
    client = anthropic.Anthropic(base_url=proxy.url, api_key="unused-in-open-mode", max_retries=0,
                                 default_headers={"X-Claude-Code-Session-Id": "cc-trainable"})
    body = {"model": vllm_server.model, "max_tokens": 8, "system": system, "tools": tools,
            "messages": [{"role": "user", "content": "Which Haiku model id should I use?"}]}
    with client.messages.stream(**body, extra_body={"temperature": 0}) as s:
        s.get_final_message()
    (step,) = proxy.steps(factory, "cc-trainable")
    assert step.redaction == {}, step.redaction
    assert step.token_source == "engine"
    direct = httpx.post(vllm_server.base_url + "/v1/chat/completions", timeout=120, json={
        **{k: v for k, v in messages_to_chat({**body, "temperature": 0}).body.items()
           if k not in ("stream", "stream_options")}, "return_token_ids": True})
    assert step.prompt_token_ids == direct.json()["prompt_token_ids"]
    assert (step.eligibility, step.eligibility_reason) == ("eligible", "ok")
    with factory() as s:
        stored = s.execute(text("select body from contents where hash = :h"), {"h": step.system_hash}).scalar_one()
    assert stored == system  # stored exactly as sent: nothing in it was mistaken for PII


@pytest.mark.vllm
def test_upstream_400_echo_is_stored_and_spanned_redacted(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url])
    spans = InMemorySpanExporter()
    proxy.state.tracer = Tracer("none", span_exporter=spans)
    # A content part type vLLM's schema rejects: its 400 (pydantic) quotes the value verbatim (values up
    # to ~50 characters; vLLM stops at the first bad part, so one request per value).
    for value in (f"{EMAIL} {PHONE}", CARD):
        body = {"model": vllm_server.model, "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": value, "text": "x"}]}]}
        r = httpx.post(proxy.v1 + "/chat/completions", json=body, headers={"x-atdp-session-id": "echo-400"},
                       timeout=120)
        assert r.status_code == 400, r.text
        # The caller gets vLLM's own answer (its own data); only what is kept must be clean.
        assert value in r.json()["error"]["message"], r.text
    steps = proxy.steps(factory, "echo-400")
    assert len(steps) == 2
    proxy.state.tracer.provider.force_flush()
    span_text = json.dumps([{"status": s.status.description, "attributes": dict(s.attributes or {})}
                            for s in spans.get_finished_spans()], default=str)
    for step in steps:
        assert step.status == "error" and step.error["status_code"] == 400
        with factory() as s:
            view = s.execute(text("select * from atdp_steps_readable where step_id = :i"), {"i": step.id}).mappings()
            view_rows = json.dumps([dict(v) for v in view], default=str)
            raw_row = json.dumps(dict(s.execute(text("select * from steps where id = :i"), {"i": step.id})
                                      .mappings().one()), default=str)
        assert step.id in view_rows, "the step is in the readable view"
        for where, dumped in (("steps row", raw_row), ("readable view", view_rows), ("span", span_text)):
            for raw in (EMAIL, "555-0132", CARD):
                assert raw not in dumped, (where, raw)
    # What stays is what an operator debugs with: which field failed and what was expected.
    for step in steps:
        assert "Input should be 'text'" in step.error["message"], step.error["message"]
        assert "input_value=<elided>" in step.error["message"]
    assert "upstream_error (HTTP 400)" in span_text
