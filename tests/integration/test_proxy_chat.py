"""The chat door against a scripted upstream: tools, sessions, errors, failover, disconnects."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.store import tables as t
from proxy.store.read import load_contents
from tests.fake_vllm import FakeVLLM, ServerThread, render

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def client(proxy, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.v1, api_key="unused-in-open-mode", max_retries=0, **kw)


def test_non_streaming_is_what_upstream_sent_and_tokens_are_captured(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    direct = httpx.post(fake_upstream.url + "/v1/chat/completions",
                        json={"model": "fake", "messages": [{"role": "user", "content": "hello"}]}).json()
    raw = httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "hello"}]})
    assert raw.status_code == 200
    got = raw.json()
    # The client did not ask for token ids or logprobs: it gets exactly vLLM's shape without them.
    assert set(got) == set(direct)
    assert got["choices"][0]["message"] == direct["choices"][0]["message"]
    assert got["choices"][0]["logprobs"] is None and "token_ids" not in got["choices"][0]
    # The upstream was asked for them, and the step holds vLLM's ids exactly.
    assert fake_upstream.requests[-1]["return_token_ids"] is True and fake_upstream.requests[-1]["logprobs"] is True
    (step,) = proxy.steps(factory)
    assert step.prompt_token_ids == list(render([{"role": "user", "content": "hello"}]))
    assert bytes(step.output_token_ids).decode() == got["choices"][0]["message"]["content"]
    assert len(step.output_logprobs) == len(step.output_token_ids)
    assert step.output_versions == [["base", len(step.output_token_ids)]]
    assert step.status == "ok" and step.finish_reason == "stop" and step.ttft_ms > 0
    assert raw.headers["x-atdp-step-id"] == step.id


def test_client_that_asks_for_token_ids_gets_them(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    got = httpx.post(proxy.v1 + "/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "x"}], "return_token_ids": True, "logprobs": True}).json()
    assert got["prompt_token_ids"] and got["choices"][0]["token_ids"]
    assert got["choices"][0]["logprobs"]["content"]


def test_streaming_passes_chunks_through_and_captures(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    stream = client(proxy).chat.completions.create(model="fake", messages=[{"role": "user", "content": "stream me"}], stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "[w0] echo: stream me"
    assert all(not c.usage for c in chunks)  # usage was added for capture only
    assert all(getattr(c.choices[0], "token_ids", None) is None for c in chunks if c.choices)
    (step,) = proxy.steps(factory)
    assert bytes(step.output_token_ids).decode() == text
    assert step.completion_tokens == len(text.encode())


def test_streaming_usage_kept_when_asked(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    chunks = list(client(proxy).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "u"}], stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_results_are_linked(start_proxy, fake_upstream, factory, stream):
    proxy = start_proxy([fake_upstream.url])
    c = client(proxy)
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": '#tool read_file {"path": "notes.txt"}'}]

    def call(msgs):
        if not stream:
            r = c.chat.completions.create(model="fake", messages=msgs, tools=TOOLS)
            return r.choices[0].message.model_dump(exclude_none=True)
        tool_calls, content = {}, ""
        for ch in c.chat.completions.create(model="fake", messages=msgs, tools=TOOLS, stream=True):
            d = ch.choices[0].delta if ch.choices else None
            if d and d.content:
                content += d.content
            for tc in (d.tool_calls or []) if d else []:
                cur = tool_calls.setdefault(tc.index, {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": ""}})
                cur["function"]["arguments"] += tc.function.arguments or ""
        msg = {"role": "assistant", "content": content or None}
        if tool_calls:
            msg["tool_calls"] = [tool_calls[i] for i in sorted(tool_calls)]
        return msg

    m1 = call(messages)
    assert m1["tool_calls"][0]["function"]["name"] == "read_file"
    call_id = m1["tool_calls"][0]["id"]
    messages += [m1, {"role": "tool", "tool_call_id": call_id, "content": "the notes say hi"},
                 {"role": "user", "content": "#say done"}]
    call(messages)
    s1, s2 = proxy.steps(factory)
    assert s2.session_id == s1.session_id and s2.parent_step_id == s1.id
    assert s2.history_len == 3  # system, user, assistant tool call: only the tool result and user turn are new
    assert len(s2.message_hashes) == 2
    with factory() as s:
        tc = s.scalar(select(t.ToolCall).where(t.ToolCall.step_id == s1.id))
    assert tc.call_id == call_id and tc.name == "read_file" and json.loads(tc.arguments) == {"path": "notes.txt"}
    assert tc.result_step_id == s2.id and tc.is_error is False
    assert s1.finish_reason == "tool_calls"
    assert s1.system_hash and s1.system_hash == s2.system_hash is not None or s2.system_hash is None


def test_five_turns_without_session_header_are_one_session(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    c = client(proxy)
    messages = [{"role": "system", "content": "be terse"}]
    for turn in range(5):
        messages.append({"role": "user", "content": f"turn {turn}"})
        r = c.chat.completions.create(model="fake", messages=messages)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    steps = proxy.steps(factory)
    assert len(steps) == 5
    assert len({s.session_id for s in steps}) == 1
    assert [s.seq for s in steps] == [1, 2, 3, 4, 5]
    assert [s.parent_step_id for s in steps[1:]] == [s.id for s in steps[:-1]]
    # Each turn stores only its new user message; the token history is stored once.
    assert [len(s.message_hashes) for s in steps] == [2, 1, 1, 1, 1]
    assert all(s.prompt_prefix_len > 0 for s in steps[1:])


def test_session_sources_and_task(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    body = {"model": "fake", "messages": [{"role": "user", "content": "a"}]}
    httpx.post(proxy.v1 + "/chat/completions", json=body, headers={"X-ATDP-Session-Id": "hdr-1", "X-ATDP-Task-Id": "task-9"})
    httpx.post(proxy.v1 + "/chat/completions", json=body, headers={"X-Claude-Code-Session-Id": "cc-1"})
    httpx.post(proxy.v1 + "/chat/completions", json={**body, "metadata": {"user_id": json.dumps({"session_id": "meta-1"})}})
    proxy.flush()
    with factory() as s:
        rows = {r.external_id: r for r in s.scalars(select(t.Session).where(t.Session.tenant_id == proxy.tenant))}
    assert {"hdr-1", "cc-1", "meta-1"} <= set(rows)  # the /s/{id} path: test_doors.py, for every door
    assert rows["hdr-1"].task_id == "task-9"


def test_errors_in_openai_format(start_proxy, fake_upstream):
    """Chat's own refusals; malformed JSON, vLLM's 400 and a wrong key are in test_doors.py."""
    proxy = start_proxy([fake_upstream.url], max_body_bytes=10_000)
    r = httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "x" * 20_000}]})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.get(proxy.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": []})
    assert r.status_code == 400


def test_api_key_auth_binds_tenant(start_proxy, fake_upstream, factory):
    from proxy.auth import create_key
    from proxy.store.db import transaction

    proxy = start_proxy([fake_upstream.url], open_mode=False)
    with transaction(factory) as s:
        _, key = create_key(s, "tenant-key-" + proxy.tenant)
    r = httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "k"}]},
                   headers={"x-api-key": key})
    assert r.status_code == 200
    proxy.flush()
    with factory() as s:
        step = t.get_step(s, r.headers["x-atdp-step-id"])
    assert step.tenant_id == "tenant-key-" + proxy.tenant


def _dead_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"




def test_failover_to_a_live_replica_and_stickiness(start_proxy, fake_upstream, factory):
    second = FakeVLLM()
    with ServerThread(second) as s2:
        proxy = start_proxy([_dead_port(), fake_upstream.url, s2.url])
        c = client(proxy)
        for i in range(4):
            r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"q{i}"}],
                                          extra_headers={"X-ATDP-Session-Id": "sticky"})
            assert r.choices[0].message.content.startswith("[w0] echo")
        steps = proxy.steps(factory, "sticky")
        assert len({s.upstream for s in steps}) == 1  # one session, one replica
        assert all(s.status == "ok" for s in steps)


def test_upstream_500_fails_over_when_nothing_was_sent(start_proxy, factory):
    bad, good = FakeVLLM(), FakeVLLM()
    bad.plan = lambda body: {"text": "", "tool_calls": [], "status": 500, "delay": 0.0}
    with ServerThread(bad) as sb, ServerThread(good) as sg:
        proxy = start_proxy([sb.url, sg.url])
        for i in range(3):
            r = client(proxy).chat.completions.create(model="fake", messages=[{"role": "user", "content": f"z{i}"}])
            assert r.choices[0].message.content.startswith("[w0]")


def test_models_routes_and_head(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    assert httpx.head(proxy.url + "/").status_code == 200
    models = client(proxy).models.list()
    assert [m.id for m in models.data] == ["fake"]
    assert client(proxy).models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError):
        client(proxy).models.retrieve("nope")
    assert httpx.get(proxy.url + "/healthz").json()["database"] is True
    assert b"atdp_requests_total" in httpx.get(proxy.url + "/metrics").content


def test_nul_characters_in_output_are_stored(start_proxy, fake_upstream, factory):
    """PostgreSQL refuses NUL in text; a model that emits one must not break persistence."""
    proxy = start_proxy([fake_upstream.url])
    r = client(proxy).chat.completions.create(model="fake", messages=[{"role": "user", "content": "#say a\x00b"}])
    assert "\x00" in r.choices[0].message.content  # the client gets exactly what the model said
    (step,) = proxy.steps(factory)
    with factory() as s:
        body = load_contents(s, proxy.tenant, {step.output_hash})[step.output_hash]
    assert body["text"] == "[w0] a\ufffdb"
    assert 0 in step.output_token_ids  # token ids are numbers: kept exactly


def test_a_record_the_database_refuses_is_set_aside_not_blocking(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    rec = proxy.state.recorder
    good = httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "one"}]})
    proxy.flush()
    # A record PostgreSQL cannot take (a token id beyond int4), then ordinary traffic.
    from proxy.store.ids import new_id
    from proxy.store.records import SessionInfo, StepRecord

    with factory() as s:
        row = t.get_step(s, good.headers["x-atdp-step-id"])
    bad = StepRecord(id=new_id(), session=SessionInfo(tenant_id=proxy.tenant, external_id="bad"),
                     api="chat.completions", status="ok", started_at=row.started_at, token_source="engine",
                     output_token_ids=[2**40], eligibility="eligible")
    rec._persist([bad])
    for i in range(3):
        httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": f"after {i}"}]})
    steps = proxy.steps(factory)
    assert len(steps) == 4  # the bad record did not stop the writer
    rejected = list((proxy.state.settings.spool_dir / "rejected").glob("*.jsonl"))
    # The reason is the error's kind and SQLSTATE: PostgreSQL's own message may quote the row's values.
    assert len(rejected) == 1 and b'"reason":"DataError: NumericValueOutOfRange (SQLSTATE 22003)"' in rejected[0].read_bytes()
    assert rec.stats["rejected"] == 1


def test_upstream_api_key_is_sent_to_vllm_not_the_clients(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url], upstream_api_key="vllm-secret")
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"authorization": "Bearer client-key"},
                   json={"model": "fake", "messages": [{"role": "user", "content": "k"}]})
    assert r.status_code == 200
    assert fake_upstream.headers[-1].get(b"authorization") == b"Bearer vllm-secret"
