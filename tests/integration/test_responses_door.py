"""The Responses door `/v1/responses`: the official SDK and Codex-shaped bodies against the scripted
upstream (namespace tools, hosted tools, sessions, `previous_response_id` and its sealed store) and
the real vLLM (token-exact capture)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.doors.response_store import Sealer
from proxy.store import tables as t
from proxy.translate.responses import responses_to_chat
from proxy.translate.sse import SSEDecoder
from tests.fake_vllm import render
from tests.session_builders import document, prompt_ids

DATA = Path(__file__).resolve().parents[1] / "data"
SHELL = {"type": "function", "name": "shell_command", "description": "Runs a shell command",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
DOCS = {"type": "namespace", "name": "mcp__docs__", "description": "Docs MCP server",
        "tools": [{"type": "function", "name": "search", "description": "Search the docs",
                   "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]}
CODEX_TOOLS = [SHELL, DOCS, {"type": "web_search", "external_web_access": False}]


def codex_request() -> dict[str, Any]:
    return json.loads((DATA / "codex_request.json").read_text())


def sdk(proxy, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.v1, api_key=kw.pop("api_key", "unused-in-open-mode"), max_retries=0, **kw)


def sse_events(data: bytes) -> list[tuple[str | None, Any]]:
    decoder = SSEDecoder()
    return [(e.event, e.json()) for e in decoder.feed(data) + decoder.flush()]


def store_of(proxy):
    return proxy.response_store


# --- scripted upstream ---------------------------------------------------------------------------


def test_non_streamed_text_is_translated_and_captured(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    raw = sdk(proxy).responses.with_raw_response.create(model="fake", instructions="be brief", input="hello")
    resp = raw.parse()
    assert resp.status == "completed" and resp.output_text == "[w0] echo: hello"
    up = fake_upstream.requests[-1]
    assert up["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    (step,) = proxy.steps(factory)
    assert raw.headers["x-atdp-step-id"] == step.id and resp.id == "resp_" + step.id.replace("-", "")
    assert step.api == "responses" and step.status == "ok"
    assert step.prompt_token_ids == list(render(up["messages"]))
    assert bytes(step.output_token_ids).decode() == resp.output_text
    assert resp.usage.input_tokens == len(step.prompt_token_ids)
    st = document(factory, step).steps[0]
    assert st.observation.system.content == "be brief"
    assert [m.content for m in st.observation.messages] == [{"role": "user", "content": "hello"}]
    assert st.action.output == [item.model_dump(exclude_unset=True) for item in resp.output]


def test_streamed_event_sequence_and_capture(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    with sdk(proxy).responses.stream(model="fake", input="stream me") as s:
        kinds = [event.type for event in s]
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.output_text == "[w0] echo: stream me"
    (step,) = proxy.steps(factory)
    assert bytes(step.output_token_ids).decode() == final.output_text
    assert final.usage.output_tokens == len(step.output_token_ids)
    assert document(factory, step).steps[0].action.output[0]["content"][0]["text"] == final.output_text


def _codex_turn(client, items: list[dict[str, Any]], stream: bool, **headers: str):
    body = {"model": "fake", "input": items, "tools": CODEX_TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": False, "store": False, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "medium", "summary": "auto"}}
    if not stream:
        raw = client.responses.with_raw_response.create(**body, extra_headers=headers)
        return raw.parse(), raw.headers
    with client.responses.with_streaming_response.create(**body, stream=True, extra_headers=headers) as r:
        events = sse_events(r.read())
        assert events[-1][0] == "response.completed"
        from openai.types.responses import Response

        return Response.model_validate(events[-1][1]["response"]), r.headers


def _codex_echo(item) -> dict[str, Any]:
    """An output item as Codex sends it back next turn (its own item shape, no annotations/logprobs)."""
    if item.type == "message":
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": c.text} for c in item.content]}
    echo = {"type": "function_call", "name": item.name, "arguments": item.arguments, "call_id": item.call_id}
    if getattr(item, "namespace", None):
        echo["namespace"] = item.namespace
    return echo


@pytest.mark.parametrize("stream", [False, True])
def test_codex_conversation_without_session_id_is_one_session(start_proxy, fake_upstream, factory, stream):
    proxy = start_proxy([fake_upstream.url])
    client = sdk(proxy)
    items: list[dict[str, Any]] = [{"type": "message", "role": "developer",
                                    "content": [{"type": "input_text", "text": "You are Codex."}]}]
    asks = ["#say I will look", '#tool mcp__docs__search {"q": "pytest"}', '#tool shell_command {"command": "pytest -q"}',
            "#say green"]
    outputs = []
    for ask in asks:
        if outputs and outputs[-1].output[-1].type == "function_call":
            items.append({"type": "function_call_output", "call_id": outputs[-1].output[-1].call_id, "output": "ok"})
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": ask}]})
        resp, headers = _codex_turn(client, items, stream)
        assert headers["x-atdp-dropped-tools"] == "web_search"
        outputs.append(resp)
        items += [_codex_echo(item) for item in resp.output]
    said, first, second, last = (o.output[-1] for o in outputs)
    assert said.type == "message" and outputs[0].output_text == "[w0] I will look"
    # The namespace tool comes back as Codex routes it: inner name + namespace.
    assert (first.type, first.name, first.namespace) == ("function_call", "search", "mcp__docs__")
    assert json.loads(first.arguments) == {"q": "pytest"}
    assert (second.name, getattr(second, "namespace", None)) == ("shell_command", None)
    assert last.type == "message" and outputs[3].output_text == "[w0] green"
    assert fake_upstream.requests[-3]["tools"][1]["function"]["name"] == "mcp__docs__search"
    steps = proxy.steps(factory)
    assert len(steps) == 4 and len({s.session_id for s in steps}) == 1
    assert [s.seq for s in steps] == [1, 2, 3, 4]
    assert [s.parent_step_id for s in steps] == [None, steps[0].id, steps[1].id, steps[2].id]
    assert [s.history_len for s in steps] == [0, 3, 5, 8]
    for step, request in zip(steps, fake_upstream.requests[-4:], strict=True):
        assert prompt_ids(factory, step) == list(render(request["messages"]))
    with factory() as s:
        calls = {c.step_id: c for c in s.scalars(select(t.ToolCall).where(t.ToolCall.session_id == steps[0].session_id))}
    assert calls[steps[1].id].call_id == first.call_id and calls[steps[1].id].result_step_id == steps[2].id
    assert calls[steps[2].id].result_step_id == steps[3].id
    doc = document(factory, steps[3])
    assert doc.steps[1].action.output[0]["namespace"] == "mcp__docs__"
    assert doc.steps[2].observation.tool_results[0].content["type"] == "function_call_output"
    with factory() as s:  # store: false (as Codex sends it): nothing kept
        assert s.scalar(select(t.StoredResponse).where(t.StoredResponse.tenant_id == proxy.tenant)) is None


def test_codex_recorded_body_and_native_session_ids(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    body = codex_request()
    r = httpx.post(proxy.v1 + "/responses", json=body,
                   headers={"session-id": "codex-s1", "originator": "codex_exec", "user-agent": "codex_exec/0.171.0"})
    assert r.status_code == 200, r.text
    assert r.headers["x-atdp-dropped-tools"] == "web_search"
    events = sse_events(r.content)
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1][0] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    up = fake_upstream.requests[-1]
    translated = responses_to_chat(body).body
    assert up["messages"] == translated["messages"] and up["tools"] == translated["tools"]
    (step,) = proxy.steps(factory, "codex-s1")
    assert step.prompt_token_ids == list(render(translated["messages"]))
    with factory() as s:
        assert s.scalar(select(t.Session).where(t.Session.external_id == "codex-s1")).client == "codex"
    doc = document(factory, step)
    assert [m.content for m in doc.steps[0].observation.messages] == body["input"]
    # Without the header, `client_metadata.session_id` names the session.
    r = httpx.post(proxy.v1 + "/responses", json={**body, "stream": False})
    assert r.status_code == 200 and r.headers["x-atdp-session-id"] == body["client_metadata"]["session_id"]


def test_previous_response_id_continues_from_the_sealed_store(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    client = sdk(proxy)
    r1 = client.responses.create(model="fake", input="remember the word plum")
    r2 = client.responses.create(model="fake", previous_response_id=r1.id, input="#say noted")
    assert r2.output_text == "[w0] noted" and r2.previous_response_id == r1.id
    assert fake_upstream.requests[-1]["messages"] == [
        {"role": "user", "content": "remember the word plum"},
        {"role": "assistant", "content": "[w0] echo: remember the word plum"},
        {"role": "user", "content": "#say noted"},
    ]
    s1, s2 = proxy.steps(factory)
    assert s2.session_id == s1.session_id and s2.parent_step_id == s1.id and s2.history_len == 2
    store = store_of(proxy)
    assert store.flush()
    with factory() as s:
        rows = {r.id: r for r in s.scalars(select(t.StoredResponse).where(t.StoredResponse.tenant_id == proxy.tenant))}
    assert set(rows) == {r1.id, r2.id} and rows[r1.id].step_id == s1.id
    row = rows[r2.id]
    assert b"plum" not in row.sealed and b"noted" not in row.sealed  # never in clear on disk
    days = (row.expires_at - row.created_at).total_seconds() / 86400
    assert 29.9 < days < 30.1
    items = Sealer(proxy.state.settings.secret).open(proxy.tenant, r2.id, row.sealed)
    assert items[0] == {"role": "user", "content": "remember the word plum"} and len(items) == 4
    with pytest.raises(Exception):  # noqa: B017 (bound to tenant and id: a moved row does not open)
        Sealer(proxy.state.settings.secret).open("another-tenant", r2.id, row.sealed)
    # Out of memory: the database answers, streamed this time.
    store._recent.clear()
    with client.responses.stream(model="fake", previous_response_id=r2.id, input="#say third") as s:
        r3 = s.get_final_response()
    assert r3.output_text == "[w0] third"
    assert [m["content"] for m in fake_upstream.requests[-1]["messages"]][-3:] == [
        "#say noted", "[w0] noted", "#say third"]
    assert proxy.steps(factory)[-1].parent_step_id == s2.id


def test_previous_response_id_unknown_foreign_or_not_stored_is_404(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    client = sdk(proxy)
    mine = client.responses.create(model="fake", input="private")
    unstored = client.responses.create(model="fake", input="ephemeral", store=False)
    for rid in ("resp_doesnotexist", unstored.id):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="fake", previous_response_id=rid, input="x")
        # The field is named, the value the caller sent is not echoed (an id may carry anything).
        assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
        assert rid not in e.value.message
    # Another tenant (the admin key acting for it) cannot continue this tenant's response, in memory or not.
    other = sdk(proxy, api_key="admin-test-key", default_headers={"x-atdp-tenant": "someone-else"})
    for clear in (False, True):
        if clear:
            assert store_of(proxy).flush()
            store_of(proxy)._recent.clear()
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model="fake", previous_response_id=mine.id, input="x")
    assert client.responses.create(model="fake", previous_response_id=mine.id, input="y").status == "completed"


def test_errors_are_openai_shaped(start_proxy, fake_upstream):
    """The door's own validation; malformed JSON, vLLM's 400, a stream that dies and a wrong key are
    in test_doors.py (every door)."""
    proxy = start_proxy([fake_upstream.url])
    r = httpx.post(proxy.v1 + "/responses", json={"model": "fake"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Missing required parameter: 'input'."
    r = httpx.post(proxy.v1 + "/responses", json={"model": "fake", "input": 5})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# --- the real vLLM (the plain answer and its tokens, for every door: test_proxy_vllm.py) ----------


def _final(client, body: dict[str, Any]):
    """The last event's response of a stream (the SDK's helper insists on `completed`; the tiny
    model usually runs into the token limit: `incomplete`)."""
    events = list(client.responses.create(**body, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def _direct(vllm_server, body: dict[str, Any], history: list[Any] | None = None) -> dict[str, Any]:
    chat = {k: v for k, v in responses_to_chat(body, history=history).body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(vllm_server.base_url + "/v1/chat/completions",
                   json={**chat, "return_token_ids": True, "logprobs": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_tool_round_trip_token_exact(start_proxy, vllm_server, factory, stream):
    # The rendered path: each step's ids are what vLLM's chat route renders for the same body. The
    # token-in-token-out path (continuations reuse the parent's ids) is tests/integration/test_tito_vllm.py.
    proxy = start_proxy([vllm_server.base_url], tito=False)
    client = sdk(proxy)
    base = {"model": vllm_server.model, "max_output_tokens": 96, "temperature": 0, "tools": [SHELL, DOCS]}

    def turn(body):
        return _final(client, body) if stream else client.responses.create(**body)

    # A named tool constrains even the random tiny model to one call (`required` makes it call
    # tools until the token limit); the namespace comes back as Codex routes it.
    first = {**base, "input": "Run the tests.",
             "tool_choice": {"type": "function", "name": "search", "namespace": "mcp__docs__"}}
    r1 = turn(copy.deepcopy(first))
    calls = [o for o in r1.output if o.type == "function_call"]
    assert [(c.name, c.namespace) for c in calls] == [("search", "mcp__docs__")]
    second = {**base, "previous_response_id": r1.id,
              "input": [{"type": "function_call_output", "call_id": c.call_id, "output": "3 passed"} for c in calls]}
    turn(copy.deepcopy(second))
    s1, s2 = proxy.steps(factory)
    history = [{"role": "user", "content": "Run the tests."}, *[o.model_dump(exclude_unset=True) for o in r1.output]]
    for step, body, hist in ((s1, first, None), (s2, {**second, "previous_response_id": None}, history)):
        direct = _direct(vllm_server, body, hist)
        assert prompt_ids(factory, step) == direct["prompt_token_ids"]
        assert step.output_token_ids == direct["choices"][0]["token_ids"]
    assert s2.session_id == s1.session_id and s2.parent_step_id == s1.id


@pytest.mark.vllm
def test_vllm_codex_recorded_body(start_proxy, vllm_server, factory):
    proxy = start_proxy([vllm_server.base_url])
    body = {**codex_request(), "max_output_tokens": 16, "temperature": 0}
    r = httpx.post(proxy.v1 + "/responses", json=body, timeout=120, headers={"session-id": "codex-vllm"})
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert events[-1][0] in ("response.completed", "response.incomplete")
    direct = _direct(vllm_server, body)
    (step,) = proxy.steps(factory, "codex-vllm")
    assert step.prompt_token_ids == direct["prompt_token_ids"]
    assert step.output_token_ids == direct["choices"][0]["token_ids"]
