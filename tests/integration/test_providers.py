"""Provider upstreams through LiteLLM: the routing table sends some models to local OpenAI- and
Anthropic-compatible stand-ins (real HTTP servers, reached through LiteLLM's `api_base`), the rest
to the scripted vLLM. All three doors, streamed and not, tools, provider errors, credentials, the
trainer's lease, and `atdp export --for sft`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from sqlalchemy import select, text

from atdp_schema.models import Eligibility, StepStatus, TokenSource
from proxy.config import UpstreamRoute
from proxy.governance.policy import PROVIDER_REASON
from proxy.store import tables as t
from proxy.store.read import load_contents
from tests.provider_standins import ANSWER, start_anthropic, start_openai, token_count

DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = Path(__file__).resolve().parents[2]
OA_KEY = f"sk-oa-{uuid.uuid4().hex}"
AN_KEY = f"sk-ant-api03-{uuid.uuid4().hex}"
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "run_shell", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]


@pytest.fixture(scope="module")
def standins():
    oa, an = start_openai(OA_KEY), start_anthropic(AN_KEY)
    yield oa, an
    oa.stop()
    an.stop()


def routes(oa, an) -> list[UpstreamRoute]:
    return [
        UpstreamRoute(model="gpt-slow", provider="openai/gpt-4o-mini", api_key_env="ATDP_TEST_OA_KEY",
                      api_base=oa.url + "/v1", timeout_s=1.0),
        UpstreamRoute(model="gpt-*", provider="openai/{model}", api_key_env="ATDP_TEST_OA_KEY", api_base=oa.url + "/v1"),
        UpstreamRoute(model="claude-*", provider="anthropic/{model}", api_key_env="ATDP_TEST_AN_KEY", api_base=an.url),
    ]


@pytest.fixture
def routed(start_proxy, fake_upstream, standins, monkeypatch):
    """(start(**kw) -> proxy, oa, an): a proxy with the routing table, everything else to the fake vLLM."""
    oa, an = standins
    for s in (oa, an):
        s.mode, s.slow_s = "text", 3.0
    oa.api_key, an.api_key = OA_KEY, AN_KEY
    monkeypatch.setenv("ATDP_TEST_OA_KEY", OA_KEY)
    monkeypatch.setenv("ATDP_TEST_AN_KEY", AN_KEY)

    def start(**kw):
        return start_proxy([fake_upstream.url], routes=routes(oa, an), **kw)

    return start, oa, an


def chat_sdk(proxy, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.v1, api_key="unused-in-open-mode", max_retries=0, **kw)


def anthropic_sdk(proxy, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="unused-in-open-mode", max_retries=0, **kw)


def output_of(factory, step: t.Step) -> dict[str, Any]:
    with factory() as s:  # as written (long texts and the native message are stored by reference)
        return load_contents(s, step.tenant_id, {step.output_hash})[step.output_hash]


def map_cost(model: str, prompt: int, completion: int) -> float:
    import litellm

    price = litellm.model_cost[model]
    return price["input_cost_per_token"] * prompt + price["output_cost_per_token"] * completion


# --- the chat door ---------------------------------------------------------------------------------


def test_chat_call_goes_to_the_provider_and_is_recorded_without_engine_tokens(routed, factory):
    start, oa, _ = routed
    proxy = start()
    raw = chat_sdk(proxy).chat.completions.with_raw_response.create(
        model="gpt-4o-mini", max_tokens=32,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "did the tests pass?"}])
    completion = raw.parse()
    assert completion.choices[0].message.content == ANSWER
    assert completion.choices[0].finish_reason == "stop"
    up, headers = oa.requests[-1], oa.headers[-1]
    assert up["model"] == "gpt-4o-mini" and up["messages"][1]["content"] == "did the tests pass?"
    assert "return_token_ids" not in up and "logprobs" not in up  # vLLM's capture fields stay on vLLM's path
    assert headers["authorization"] == f"Bearer {OA_KEY}"  # the credential from the environment reached it
    (step,) = proxy.steps(factory, raw.headers["x-atdp-session-id"])
    assert step.status == StepStatus.ok and step.api == "chat.completions"
    assert step.token_source == TokenSource.none and step.prompt_token_ids == [] and step.output_token_ids == []
    assert step.model == "gpt-4o-mini" and step.model_version == "openai/gpt-4o-mini"
    assert step.upstream == f"litellm:openai@{oa.url}"
    assert step.eligibility == Eligibility.eligible and step.eligibility_reason == PROVIDER_REASON
    assert (step.prompt_tokens, step.completion_tokens) == (completion.usage.prompt_tokens,
                                                            completion.usage.completion_tokens)
    assert step.cost == pytest.approx(map_cost("gpt-4o-mini", step.prompt_tokens, step.completion_tokens))
    assert step.cost > 0
    assert output_of(factory, step)["text"] == ANSWER


def test_chat_stream_with_a_tool_call(routed, factory):
    start, oa, _ = routed
    proxy = start(stream_interval=4)  # vLLM's own field: never sent to a provider
    oa.mode = "tool"
    stream = chat_sdk(proxy).chat.completions.create(
        model="gpt-4o-mini", stream=True, tools=CHAT_TOOLS, messages=[{"role": "user", "content": "run the tests"}],
        extra_headers={"x-atdp-session-id": "prov-chat-stream"})
    name, args, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                name += tc.function.name or ""
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, json.loads(args), finish) == ("run_shell", {"cmd": "pytest -q"}, "tool_calls")
    assert oa.requests[-1]["stream"] is True and oa.requests[-1]["tools"][0]["function"]["name"] == "run_shell"
    assert "stream_interval" not in oa.requests[-1]
    (step,) = proxy.steps(factory, "prov-chat-stream")
    assert step.status == StepStatus.ok and step.token_source == TokenSource.none and step.finish_reason == "tool_calls"
    assert step.ttft_ms is not None and step.ttft_ms <= step.total_ms
    out = output_of(factory, step)
    assert [(c["name"], json.loads(c["arguments"])) for c in out["tool_calls"]] == [("run_shell", {"cmd": "pytest -q"})]
    assert step.cost == pytest.approx(map_cost("gpt-4o-mini", step.prompt_tokens, step.completion_tokens))


def test_models_without_a_provider_route_still_go_to_vllm(routed, fake_upstream, factory):
    start, oa, an = routed
    proxy = start()
    seen = len(oa.requests) + len(an.requests)
    r = chat_sdk(proxy).chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert r.parse().choices[0].message.content
    assert len(oa.requests) + len(an.requests) == seen
    assert fake_upstream.requests[-1]["return_token_ids"] is True
    (step,) = proxy.steps(factory, r.headers["x-atdp-session-id"])
    assert step.token_source == TokenSource.engine and step.output_token_ids and step.cost is None
    assert step.eligibility_reason == "ok"


# --- the Anthropic and Responses doors: Claude Code and Codex shaped calls ----------------------------


def claude_code_call(proxy, an, session: str) -> list[str]:
    body = json.loads((DATA / "claude_code_request.json").read_text())
    an.mode = "tool"
    known = ("max_tokens", "messages", "system", "tools", "metadata", "thinking")
    stream = anthropic_sdk(proxy).messages.create(
        model="claude-sonnet-4-5", stream=True, **{k: body[k] for k in known},
        extra_body={k: v for k, v in body.items() if k not in (*known, "model", "stream")},
        extra_headers={"X-Claude-Code-Session-Id": session})
    return [event.type for event in stream]


def test_claude_code_call_to_an_anthropic_provider(routed, factory):
    start, _, an = routed
    proxy = start()
    kinds = claude_code_call(proxy, an, "prov-claude-code")
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    up = an.requests[-1]
    assert an.headers[-1]["x-api-key"] == AN_KEY and up["model"] == "claude-sonnet-4-5" and up["stream"] is True
    assert {tool["name"] for tool in up["tools"]} >= {"Bash", "Read"}
    (step,) = proxy.steps(factory, "prov-claude-code")
    assert step.api == "messages" and step.status == StepStatus.ok and step.token_source == TokenSource.none
    assert step.model_version == "anthropic/claude-sonnet-4-5" and step.finish_reason == "tool_calls"
    out = output_of(factory, step)
    assert [(c["name"], json.loads(c["arguments"])) for c in out["tool_calls"]] == [
        ("Bash", {"command": "pytest -q", "description": "run the tests"})]
    assert out["output"]["content"][0]["type"] == "tool_use"  # the client's own shape is kept
    assert step.cost == pytest.approx(map_cost("claude-sonnet-4-5", step.prompt_tokens, step.completion_tokens))


def codex_call(proxy, session: str) -> list[Any]:
    body = json.loads((DATA / "codex_request.json").read_text())
    known = ("input", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "store", "include", "text")
    stream = chat_sdk(proxy).responses.create(
        model="gpt-4o-mini", stream=True, **{k: body[k] for k in known},
        extra_body={k: v for k, v in body.items() if k not in (*known, "model", "stream")},
        extra_headers={"session-id": session})
    return list(stream)


def test_codex_call_to_an_openai_provider(routed, factory):
    start, oa, _ = routed
    proxy = start()
    oa.mode = "tool"
    events = codex_call(proxy, "prov-codex")
    assert events[-1].type == "response.completed"
    items = events[-1].response.output
    assert [(i.type, i.name) for i in items] == [("function_call", "shell_command")]
    assert json.loads(items[0].arguments) == {"cmd": "pytest -q"}
    assert oa.requests[-1]["model"] == "gpt-4o-mini"
    (step,) = proxy.steps(factory, "prov-codex")
    assert step.api == "responses" and step.status == StepStatus.ok and step.token_source == TokenSource.none
    assert step.model_version == "openai/gpt-4o-mini" and step.eligibility == Eligibility.eligible


def test_non_streamed_messages_and_responses_calls(routed, factory):
    start, oa, an = routed
    proxy = start()
    msg = anthropic_sdk(proxy).messages.with_raw_response.create(
        model="claude-haiku-4-5", max_tokens=32, system="be brief", messages=[{"role": "user", "content": "done?"}],
        extra_headers={"x-atdp-session-id": "prov-plain-messages"})
    assert [b.text for b in msg.parse().content] == [ANSWER] and msg.parse().stop_reason == "end_turn"
    assert an.requests[-1]["system"][0]["text"] == "be brief" and an.requests[-1].get("stream") in (None, False)
    resp = chat_sdk(proxy).responses.with_raw_response.create(model="gpt-4.1-mini", input="done?", instructions="brief",
                                                               extra_headers={"x-atdp-session-id": "prov-plain-responses"})
    assert resp.parse().output_text == ANSWER
    assert oa.requests[-1]["messages"][0] == {"role": "system", "content": "brief"}
    for raw, api, version in ((msg, "messages", "anthropic/claude-haiku-4-5"), (resp, "responses", "openai/gpt-4.1-mini")):
        (step,) = proxy.steps(factory, raw.headers["x-atdp-session-id"])
        assert (step.api, step.status, step.token_source, step.model_version) == (api, "ok", "none", version)
        assert output_of(factory, step)["text"] == ANSWER and step.cost and step.cost > 0


def test_a_client_leaving_mid_stream_closes_the_provider_stream(routed, factory):
    start, oa, _ = routed
    proxy = start()
    oa.mode, oa.slow_s, closed = "drip", 2.0, oa.closed
    with httpx.stream("POST", proxy.v1 + "/chat/completions", timeout=30, headers={"x-atdp-session-id": "prov-leave"},
                      json={"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
        first = next(r.iter_bytes())
        assert b"Checked" in first or b"assistant" in first
    deadline = time.monotonic() + 30
    while not proxy.steps(factory, "prov-leave") and time.monotonic() < deadline:  # recorded once the proxy sees it
        time.sleep(0.2)
    (step,) = proxy.steps(factory, "prov-leave")
    assert step.status == StepStatus.aborted and step.error["type"] == "client_disconnected"
    while oa.closed == closed and time.monotonic() < deadline:  # the provider's stream is closed, not left to run
        time.sleep(0.2)
    assert oa.closed == closed + 1


def test_count_tokens_for_a_provider_model_asks_the_provider(routed):
    start, _, an = routed
    proxy = start()
    messages = [{"role": "user", "content": "how many tokens is this question?"}]
    got = anthropic_sdk(proxy).messages.count_tokens(model="claude-sonnet-4-5", system="be brief", messages=messages)
    up = an.requests[-1]
    assert an.headers[-1]["x-api-key"] == AN_KEY and up["model"] == "claude-sonnet-4-5"
    assert got.input_tokens == token_count(up) and "how many tokens" in json.dumps(up["messages"])
    # The provider's counting API refuses: LiteLLM counts with its local tokenizer instead.
    an.api_key = "sk-some-other-key"
    assert anthropic_sdk(proxy).messages.count_tokens(model="claude-sonnet-4-5", messages=messages).input_tokens > 0


# --- provider errors, in the caller's format ---------------------------------------------------------

DOORS = {
    "chat": ("/v1/chat/completions", lambda model, stream: {
        "model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}),
    "messages": ("/v1/messages", lambda model, stream: {
        "model": model, "stream": stream, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", lambda model, stream: {"model": model, "stream": stream, "input": "hi"}),
}


def error_message(door: str, data: dict[str, Any]) -> str:
    if door == "messages":
        assert data["type"] == "error"
    return data["error"]["message"]


@pytest.mark.parametrize("door", list(DOORS))
def test_provider_errors_come_back_in_the_callers_format_and_are_recorded(routed, factory, door):
    start, oa, an = routed
    proxy = start()
    path, body_of = DOORS[door]
    cases = [("error:400", "gpt-4o-mini", 400), ("error:429", "claude-haiku-4-5", 429),
             ("error:500", "gpt-4o-mini", 502), ("error:529", "claude-haiku-4-5", 502), ("slow", "gpt-slow", 504)]
    for n, (mode, model, status) in enumerate(cases):
        for stream in (False, True):
            oa.mode = an.mode = mode
            sid = f"prov-err-{door}-{n}-{stream}"
            r = httpx.post(proxy.url + path, json=body_of(model, stream), headers={"x-atdp-session-id": sid}, timeout=30)
            assert r.status_code == status, (mode, stream, r.text)
            message = error_message(door, r.json())
            assert ("did not answer in time" in message) if mode == "slow" else ("stand-in refused" in message)
            (step,) = proxy.steps(factory, sid)
            assert step.status == StepStatus.error and step.token_source == TokenSource.none
            assert step.error["status_code"] == status
            assert step.model_version.startswith(("openai/", "anthropic/"))


@pytest.mark.parametrize("door", ["chat", "messages"])
def test_a_provider_stream_that_breaks_is_an_error_event_and_a_failed_step(routed, factory, door):
    start, oa, an = routed
    proxy = start()
    oa.mode = an.mode = "break"
    path, body_of = DOORS[door]
    model = "gpt-4o-mini" if door == "chat" else "claude-sonnet-4-5"
    sid = f"prov-break-{door}"
    r = httpx.post(proxy.url + path, json=body_of(model, True), headers={"x-atdp-session-id": sid}, timeout=30)
    assert r.status_code == 200  # the stream had started
    assert b"Checked:" in r.content and b"stream broke" in r.content
    (step,) = proxy.steps(factory, sid)
    assert step.status == StepStatus.error and "stream broke" in step.error["message"]


def test_credentials_reach_the_provider_but_never_the_store_logs_or_errors(routed, factory, caplog, capfd):
    start, oa, an = routed
    caplog.set_level(logging.DEBUG)
    proxy = start()
    chat_sdk(proxy).chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    claude_code_call(proxy, an, "prov-cred-claude")
    assert oa.headers[-1]["authorization"] == f"Bearer {OA_KEY}" and an.headers[-1]["x-api-key"] == AN_KEY
    # The provider refuses the proxy's key and quotes it (as OpenAI does): not the caller's fault (502),
    # and the key is cut out of what the caller and the store see.
    oa.api_key = "sk-some-other-key"
    r = httpx.post(proxy.v1 + "/chat/completions", json={"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "hi"}]}, headers={"x-atdp-session-id": "prov-cred-401"}, timeout=30)
    assert r.status_code == 502 and "[credential]" in r.json()["error"]["message"]
    assert OA_KEY not in oa.requests and OA_KEY not in r.text
    proxy.flush()
    (step,) = proxy.steps(factory, "prov-cred-401")
    assert step.status == StepStatus.error and OA_KEY not in json.dumps(step.error)
    seen = [httpx.get(proxy.url + p).text for p in ("/healthz", "/metrics")]
    with factory() as s:
        tables = s.execute(text("select tablename from pg_tables where schemaname = 'public'")).scalars().all()
        for name in tables:
            seen.append(s.execute(text(f'select coalesce(string_agg(x::text, \'\'), \'\') from "{name}" x')).scalar())
    out, err = capfd.readouterr()
    seen += [caplog.text, out, err, repr(proxy.state.routes), repr(proxy.state.settings)]
    for key in (OA_KEY, AN_KEY):
        assert not any(key in s for s in seen)


# --- never PPO, always SFT -------------------------------------------------------------------------


def test_the_trainers_lease_never_takes_provider_steps(routed, own_db):
    from tests.diagnosis_seed import feedback
    from trainer import lease

    url, factory = own_db
    start, _, _ = routed
    proxy = start(database_url=url)
    for sid, model in (("prov-lease", "gpt-4o-mini"), ("vllm-lease", "fake")):
        chat_sdk(proxy).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                extra_headers={"x-atdp-session-id": sid})
        feedback(proxy, sid, reward=1.0)
    with factory() as s:
        sources = dict(s.execute(select(t.Session.external_id, t.Step.token_source).join(
            t.Step, t.Step.session_id == t.Session.id)).all())
        assert sources == {"prov-lease": TokenSource.none, "vllm-lease": TokenSource.engine}
        assert lease.count_ready(s) == 1
        (taken,) = lease.lease(s, owner="A", ttl_s=60, max_steps=100)
        assert t.get_step(s, taken).token_source == TokenSource.engine


# A chat template that reads what TRL hands `apply_chat_template`: tools as schemas, tool-call
# arguments as a mapping (`.items()` fails on a string), tool results with the tool's name.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<call {{ tc.function.name }}>"
    "{% for k, v in tc.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}</call>{% endfor %}"
    "{% if m.role == 'tool' %}[{{ m.name }}]{% endif %}</{{ m.role }}>{% endfor %}"
)


def render(line: dict[str, Any]) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  unk_token="<unk>", chat_template=TEMPLATE)
    return tok.apply_chat_template(line["messages"], tools=line.get("tools"), tokenize=False)


def export(url: str, home: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "ATDP_DATABASE_URL": url, "ATDP_HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "proxy.cli", "export", *args], env=env, cwd=ROOT, capture_output=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    return [orjson.loads(line) for line in r.stdout.splitlines()], r.stderr.decode()


def test_sft_export_has_the_claude_code_and_codex_turns_and_rl_export_does_not(routed, own_db, tmp_path):
    url, factory = own_db
    start, oa, an = routed
    proxy = start(database_url=url)
    claude_code_call(proxy, an, "sft-claude")
    oa.mode = "tool"
    codex_call(proxy, "sft-codex")
    # A two-turn chat with a tool result, then the final answer; and one vLLM call.
    client = chat_sdk(proxy)
    first = [{"role": "system", "content": "You run tests."}, {"role": "user", "content": "run them"}]
    msg = client.chat.completions.create(model="gpt-4o-mini", tools=CHAT_TOOLS, messages=first,
                                         extra_headers={"x-atdp-session-id": "sft-chat"}).choices[0].message
    oa.mode = "text"
    client.chat.completions.create(model="gpt-4o-mini", tools=CHAT_TOOLS, messages=[
        *first, msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                                     "content": "3 passed"}],
        extra_headers={"x-atdp-session-id": "sft-chat"})
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hello"}],
                                   extra_headers={"x-atdp-session-id": "sft-vllm"})
    proxy.flush()

    lines, note = export(url, tmp_path, "--for", "sft", "--tenant", proxy.tenant)
    assert len(lines) == 5 and "exported 5 assistant turns from 4 sessions" in note
    for line in lines:
        assert line["messages"][-1]["role"] == "assistant" and set(line) <= {"messages", "tools"}
        render(line)  # what TRL's SFTTrainer does with a conversational line
    by_first_tool = {}
    for line in lines:
        calls = line["messages"][-1].get("tool_calls") or [{"function": {"name": None}}]
        by_first_tool.setdefault(calls[0]["function"]["name"], []).append(line)
    (claude,) = by_first_tool["Bash"]
    assert claude["messages"][0]["role"] == "system" and "Claude" in claude["messages"][0]["content"]
    assert claude["messages"][-1]["tool_calls"][0]["function"]["arguments"] == {
        "command": "pytest -q", "description": "run the tests"}
    assert {tool["function"]["name"] for tool in claude["tools"]} >= {"Bash", "Read"}
    (codex,) = by_first_tool["shell_command"]
    assert codex["messages"][-1]["tool_calls"][0]["function"]["arguments"] == {"cmd": "pytest -q"}
    assert "<call shell_command>cmd=pytest -q;</call>" in render(codex)
    (chat_first,) = by_first_tool["run_shell"]
    assert [m["role"] for m in chat_first["messages"]] == ["system", "user", "assistant"]
    texts = by_first_tool[None]
    final = next(line for line in texts if len(line["messages"]) == 5)
    assert [m["role"] for m in final["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert final["messages"][3] == {"role": "tool", "content": "3 passed", "name": "run_shell"}
    assert final["messages"][-1]["content"] == ANSWER
    assert "[run_shell]" in render(final)

    provider_only, _ = export(url, tmp_path, "--for", "sft", "--tenant", proxy.tenant, "--provider-only")
    assert len(provider_only) == 4  # the vLLM turn is not distillation data
    other_tenant, _ = export(url, tmp_path, "--for", "sft", "--tenant", "someone-else")
    assert other_tenant == []
    rl, _ = export(url, tmp_path, "--eligible", "--format", "jsonl", "--tenant", proxy.tenant)
    assert [sample["session_id"] for sample in rl] == ["sft-vllm"]  # engine tokens only


def test_serve_without_provider_routes_never_imports_litellm(fake_upstream, db_url, tmp_path):
    script = f"""
import sys, httpx
from proxy.app import create_app
from proxy.config import Settings, UpstreamRoute
from tests.fake_vllm import ServerThread
routes = [UpstreamRoute(model="local-*", provider="vllm")]
settings = Settings(home={str(tmp_path)!r}, database_url={db_url!r}, upstream_urls=[{fake_upstream.url!r}],
                    open_mode=True, secret=b"s", writer_mode="thread", routes=routes)
with ServerThread(create_app(settings)) as server:
    r = httpx.post(server.url + "/v1/chat/completions", json={{"model": "local-1", "messages": [
        {{"role": "user", "content": "hi"}}]}}, timeout=30)
    assert r.status_code == 200, r.text
assert "litellm" not in sys.modules, "litellm was imported"
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=180)
    assert r.returncode == 0 and r.stdout.strip() == b"ok", r.stderr.decode()[-2000:]


def test_provider_sessions_show_up_in_the_consoles_data(routed, factory):
    """The console's pages draw the listing and the session from these two routes (proxy/console):
    provider steps are listed under their provider model and read back with their tool calls."""
    start, oa, _ = routed
    proxy = start()
    claude_code_call(proxy, routed[2], "prov-console-cc")
    oa.mode = "tool"
    codex_call(proxy, "prov-console-codex")
    proxy.flush()
    admin = {"Authorization": "Bearer admin-test-key"}
    for version, session in (("anthropic/claude-sonnet-4-5", "prov-console-cc"), ("openai/gpt-4o-mini", "prov-console-codex")):
        listed = httpx.get(f"{proxy.url}/atdp/v1/sessions", params={"version": version}, headers=admin).json()
        ids = [row.get("session_id") or row.get("id") for row in listed["data"]]
        assert session in ids, (version, listed)
        detail = httpx.get(f"{proxy.url}/atdp/v1/sessions/{session}", headers=admin)
        assert detail.status_code == 200, detail.text
        steps = detail.json()["steps"]
        assert [s["model_version"] for s in steps] == [version]
        assert steps[0]["action"]["tool_calls"], steps[0]["action"]  # what the timeline draws
