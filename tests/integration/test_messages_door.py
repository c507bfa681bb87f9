"""The Anthropic door `/v1/messages`: the official SDK and Claude-Code-shaped bodies against the
scripted upstream (tool calls, errors, sessions) and the real vLLM (token-exact capture, count_tokens)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from sqlalchemy import select

from proxy.store import tables as t
from proxy.translate.anthropic import messages_to_chat
from proxy.translate.sse import SSEDecoder
from tests.fake_vllm import render
from tests.session_builders import document, prompt_ids

DATA = Path(__file__).resolve().parents[1] / "data"
BASH = {"name": "Bash", "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
READ = {"name": "Read", "description": "Read a file", "cache_control": {"type": "ephemeral"},
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197"},
          {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]


def claude_code_request() -> dict[str, Any]:
    return json.loads((DATA / "claude_code_request.json").read_text())


def sdk(proxy, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused-in-open-mode")
    return anthropic.Anthropic(base_url=proxy.url, max_retries=0, **kw)


def sse_events(data: bytes) -> list[tuple[str | None, Any]]:
    decoder = SSEDecoder()
    return [(e.event, e.json()) for e in decoder.feed(data) + decoder.flush()]


def fake_prompt_ids(body: dict[str, Any]) -> list[int]:
    """What the scripted upstream renders for the translated request (one id per byte)."""
    return list(render(messages_to_chat(body).body["messages"]))


# --- scripted upstream ---------------------------------------------------------------------------


def test_non_streamed_text_is_translated_and_captured(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    raw = sdk(proxy).messages.with_raw_response.create(
        model="fake", max_tokens=64, system="be brief", messages=[{"role": "user", "content": "hello"}])
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "[w0] echo: hello"
    up = fake_upstream.requests[-1]
    assert up["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert up["return_token_ids"] is True and up["logprobs"] is True and up["max_tokens"] == 64
    (step,) = proxy.steps(factory)
    assert raw.headers["x-atdp-step-id"] == step.id and msg.id == "msg_" + step.id.replace("-", "")
    assert step.api == "messages" and step.status == "ok" and step.finish_reason == "stop"
    assert step.prompt_token_ids == list(render(up["messages"]))
    assert bytes(step.output_token_ids).decode() == msg.content[0].text
    assert msg.usage.input_tokens == len(step.prompt_token_ids) and msg.usage.output_tokens == len(step.output_token_ids)
    # The observation and action keep the Anthropic shape.
    st = document(factory, step).steps[0]
    assert st.observation.api == "messages" and st.observation.system.content == "be brief"
    assert [m.content for m in st.observation.messages] == [{"role": "user", "content": "hello"}]
    assert st.action.output["content"] == [{"type": "text", "text": "[w0] echo: hello"}]
    assert st.action.output["id"] == msg.id and st.action.text == msg.content[0].text


def test_streamed_event_sequence_and_capture(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    r = httpx.post(proxy.url + "/v1/messages?beta=true", json={
        "model": "fake", "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "stream me"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert b"event: message_start\n" in r.content and b"[DONE]" not in r.content
    events = sse_events(r.content)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "[w0] echo: stream me"
    (step,) = proxy.steps(factory)
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(step.prompt_token_ids)
    assert events[-2][1]["usage"]["output_tokens"] == len(step.output_token_ids)
    assert bytes(step.output_token_ids).decode() == text and step.ttft_ms is not None
    st = document(factory, step).steps[0]
    assert st.action.output["content"] == [{"type": "text", "text": text}]
    assert st.action.output["stop_reason"] == "end_turn"


def test_sdk_stream_helper(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    with sdk(proxy).messages.stream(model="fake", max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as s:
        deltas = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(deltas) == final.content[0].text == "[w0] echo: hi"
    (step,) = proxy.steps(factory)
    assert step.status == "ok" and bytes(step.output_token_ids).decode() == "[w0] echo: hi"


def _turn(client, body: dict[str, Any], stream: bool):
    body = dict(body)
    extra = {"temperature": body.pop("temperature")} if "temperature" in body else None  # not an SDK argument
    if stream:
        with client.messages.stream(**body, extra_body=extra) as s:
            return s.get_final_message()
    return client.messages.create(**body, extra_body=extra)


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_conversation_without_session_id_is_one_session(start_proxy, fake_upstream, factory, stream):
    """Three tool turns, Claude Code style (blocks, cache_control moving to the newest block), no id."""
    proxy = start_proxy([fake_upstream.url])
    client = sdk(proxy)
    messages: list[dict[str, Any]] = []
    asks = ['#tool Bash {"command": "ls"}', '#tool Read {"file_path": "README.md"}', "#say all done"]
    outputs = []
    for turn, ask in enumerate(asks):
        for m in messages:  # Claude Code keeps one cache breakpoint: on the newest user block
            if m["role"] == "user" and isinstance(m["content"], list):
                for b in m["content"]:
                    b.pop("cache_control", None)
        blocks: list[dict[str, Any]] = []
        if outputs and outputs[-1].stop_reason == "tool_use":
            use = outputs[-1].content[-1]
            blocks.append({"type": "tool_result", "tool_use_id": use.id, "content": f"result {turn}"})
        blocks.append({"type": "text", "text": ask, "cache_control": {"type": "ephemeral"}})
        messages.append({"role": "user", "content": blocks})
        out = _turn(client, {"model": "fake", "max_tokens": 1000, "system": SYSTEM, "tools": [BASH, READ],
                             "messages": messages}, stream)
        outputs.append(out)
        # The SDK's own objects go back as the assistant turn (None fields and all).
        messages.append({"role": "assistant", "content": [b.model_dump() for b in out.content]})
    assert [o.stop_reason for o in outputs] == ["tool_use", "tool_use", "end_turn"]
    assert outputs[0].content[-1].name == "Bash" and outputs[0].content[-1].input == {"command": "ls"}
    assert outputs[1].content[-1].input == {"file_path": "README.md"}
    steps = proxy.steps(factory)
    assert len(steps) == 3 and len({s.session_id for s in steps}) == 1
    assert [s.seq for s in steps] == [1, 2, 3]
    assert [s.parent_step_id for s in steps] == [None, steps[0].id, steps[1].id]
    assert [s.history_len for s in steps] == [0, 2, 4]
    with factory() as s:
        calls = list(s.scalars(select(t.ToolCall).where(t.ToolCall.session_id == steps[0].session_id)
                               .order_by(t.ToolCall.call_id)))
    by_step = {c.step_id: c for c in calls}
    assert by_step[steps[0].id].name == "Bash" and by_step[steps[0].id].result_step_id == steps[1].id
    assert by_step[steps[1].id].name == "Read" and by_step[steps[1].id].result_step_id == steps[2].id
    doc = document(factory, steps[2])
    results = doc.steps[2].observation.tool_results
    assert results[0].tool_call_id == outputs[1].content[-1].id and results[0].content["content"] == "result 2"
    assert doc.steps[0].action.tool_calls[0].name == "Bash"
    # Each prompt is exactly what the upstream rendered for the translated request.
    for step, request in zip(steps, fake_upstream.requests[-3:], strict=True):
        assert prompt_ids(factory, step) == list(render(request["messages"]))
    assert steps[2].prompt_prefix_len > 0  # the token history is stored once


def test_claude_code_recorded_body_with_header_session(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    body = claude_code_request()
    r = httpx.post(proxy.url + "/v1/messages?beta=true", json=body,
                   headers={"X-Claude-Code-Session-Id": "cc-session-1", "anthropic-version": "2023-06-01",
                            "anthropic-beta": "claude-code-20250219", "user-agent": "claude-cli/2.1.197 (external, sdk-cli)",
                            "x-api-key": "sk-ant-placeholder"})
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert events[-1][0] == "message_stop"
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == "[w0] echo: continue"
    up = fake_upstream.requests[-1]
    assert up["messages"] == messages_to_chat(body).body["messages"]  # system blocks, mid system, tool results
    assert [tool["function"]["name"] for tool in up["tools"]] == ["Bash", "Read"]  # web_search dropped
    assert not ({"thinking", "output_config", "context_management", "metadata"} & set(up))
    (step,) = proxy.steps(factory, "cc-session-1")
    assert step.prompt_token_ids == fake_prompt_ids(body)
    doc = document(factory, step)
    assert doc.steps[0].observation.system.content == body["system"]  # blocks, cache_control kept
    assert [m.content for m in doc.steps[0].observation.messages] == body["messages"]
    with factory() as s:
        sess = s.scalar(select(t.Session).where(t.Session.external_id == "cc-session-1"))
    assert sess.client == "claude-code"


def test_metadata_user_id_session(start_proxy, fake_upstream, factory):
    """`metadata.user_id` (Claude Code's JSON) names the session; the /s/{id} path is in test_doors.py."""
    proxy = start_proxy([fake_upstream.url])
    body = claude_code_request()
    body["stream"] = False
    r = httpx.post(proxy.url + "/v1/messages", json=body)  # metadata.user_id JSON names the session
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "[w0] echo: continue"
    session = json.loads(body["metadata"]["user_id"])["session_id"]
    assert r.headers["x-atdp-session-id"] == session
    assert len(proxy.steps(factory, session)) == 1


def test_errors_are_anthropic_shaped(start_proxy, fake_upstream):
    """The door's own validation; malformed JSON, vLLM's 400, a stream that dies and a wrong key are
    in test_doors.py (every door)."""
    proxy = start_proxy([fake_upstream.url])
    url = proxy.url + "/v1/messages?beta=true"
    r = httpx.post(url, json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})  # no max_tokens
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(proxy.url + "/v1/messages/count_tokens?beta=true", json={"model": "fake"})
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                          "message": "messages: Field required"}






def test_bearer_and_x_api_key_both_authenticate(start_proxy, fake_upstream, factory):
    from proxy.auth import create_key
    from proxy.store.db import transaction

    proxy = start_proxy([fake_upstream.url], open_mode=False)
    with transaction(factory) as s:
        _, key = create_key(s, "tenant-" + proxy.tenant)
    body = {"model": "fake", "max_tokens": 10, "messages": [{"role": "user", "content": "k"}]}
    by_header = sdk(proxy, api_key=key).messages.with_raw_response.create(**body)  # x-api-key
    by_bearer = anthropic.Anthropic(base_url=proxy.url, auth_token=key, max_retries=0).messages.with_raw_response.create(**body)
    assert by_bearer.http_request.headers["authorization"] == f"Bearer {key}"
    assert "x-api-key" not in by_bearer.http_request.headers
    proxy.flush()
    with factory() as s:
        for raw in (by_header, by_bearer):
            assert t.get_step(s, raw.headers["x-atdp-step-id"]).tenant_id == "tenant-" + proxy.tenant


# --- the real vLLM (the plain answer and its tokens, for every door: test_proxy_vllm.py) ----------


def _direct(vllm_server, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own answer to the translated request, non-streamed, with token ids."""
    chat = {k: v for k, v in messages_to_chat(body).body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(vllm_server.base_url + "/v1/chat/completions",
                   json={**chat, "return_token_ids": True, "logprobs": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.vllm
def test_vllm_count_tokens_is_the_prompt_vllm_renders(start_proxy, vllm_server):
    """count_tokens renders the same prompt with the model's chat template. (The answer and its tokens
    against vLLM, for every door: test_proxy_vllm.py.)"""
    proxy = start_proxy([vllm_server.base_url])
    client = sdk(proxy, auth_token="bearer-key", api_key=None)
    body = {"model": vllm_server.model, "max_tokens": 12, "system": "Be short.",
            "messages": [{"role": "user", "content": "Say something."}]}
    direct = _direct(vllm_server, {**body, "temperature": 0})
    counted = client.messages.count_tokens(model=vllm_server.model, system="Be short.", messages=body["messages"])
    assert counted.input_tokens == len(direct["prompt_token_ids"])


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_tool_round_trip_token_exact(start_proxy, vllm_server, factory, stream):
    # The rendered path: each step's ids are what vLLM's chat route renders for the same body. The
    # token-in-token-out path (continuations reuse the parent's ids) is tests/integration/test_tito_vllm.py.
    proxy = start_proxy([vllm_server.base_url], tito=False)
    client = sdk(proxy)
    base = {"model": vllm_server.model, "max_tokens": 96, "temperature": 0, "tools": [BASH],
            "system": SYSTEM}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    first = {**base, "messages": copy.deepcopy(messages), "tool_choice": {"type": "any"}}
    out = _turn(client, first, stream)
    uses = [b for b in out.content if b.type == "tool_use"]
    assert uses and uses[0].name == "Bash" and out.stop_reason == "tool_use"
    messages.append({"role": "assistant", "content": [b.model_dump() for b in out.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "a.txt"}
                                                 for u in uses]})
    second = {**base, "messages": copy.deepcopy(messages)}
    out2 = _turn(client, second, stream)
    assert out2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    s1, s2 = proxy.steps(factory)
    for step, body in ((s1, first), (s2, second)):
        direct = _direct(vllm_server, body)
        assert prompt_ids(factory, step) == direct["prompt_token_ids"]
        assert step.output_token_ids == direct["choices"][0]["token_ids"]
    assert s2.session_id == s1.session_id and s2.parent_step_id == s1.id and s2.history_len == 2


@pytest.mark.vllm
def test_vllm_claude_code_recorded_body(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url])
    body = {**claude_code_request(), "max_tokens": 16, "temperature": 0}
    r = httpx.post(proxy.url + "/v1/messages?beta=true", json=body, timeout=120,
                   headers={"X-Claude-Code-Session-Id": "cc-vllm", "authorization": "Bearer sk-placeholder"})
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    direct = _direct(vllm_server, body)
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == (direct["choices"][0]["message"]["content"] or "")
    (step,) = proxy.steps(factory, "cc-vllm")
    assert step.prompt_token_ids == direct["prompt_token_ids"]
    assert step.output_token_ids == direct["choices"][0]["token_ids"]
    count = httpx.post(proxy.url + "/v1/messages/count_tokens?beta=true", json=body, timeout=60)
    assert count.status_code == 200 and count.json() == {"input_tokens": len(direct["prompt_token_ids"])}
