"""Bad input gets a 4xx in the called API's error shape, before the upstream, on every door and control
route it applies to (issue 13: these gave plain-text 500s, reset connections, or a 200 whose step went
to the dead-letter folder).

The proxy runs in front of the real tiny vLLM. Model-door inputs are sent with the official `openai` /
`anthropic` SDKs (they pass dicts through unchecked); control routes and inputs no SDK can send (a NUL
in a URL path) with httpx. Every bad value carries MARK: no error body may echo it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.app import create_app
from proxy.config import Settings
from proxy.record import deadletters
from proxy.store import tables as t
from tests.fake_vllm import ServerThread
from tests.proxy_fixtures import RunningProxy, shared_redactor, wait_for_db

pytestmark = pytest.mark.vllm

MARK = "PII-MARK-4711"
LONG = "s" * 250 + MARK  # 263 characters: over the 256 an id may have
NUL = "a\x00" + MARK
ADMIN = {"authorization": "Bearer admin-test-key"}


def _deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


DEEP = _deep(300)


@dataclass(frozen=True)
class Bad:
    name: str
    send: Callable[[Any, str], httpx.Response]  # (running proxy, served model) -> the proxy's answer
    flavor: str = "openai"  # the error shape: "openai" (chat, responses, ATDP routes) or "anthropic"
    status: int = 400


# --- senders ---------------------------------------------------------------------------------------


def _refused(fn: Callable[[], Any]) -> httpx.Response:
    """Call an SDK; it must raise its status error; return the raw HTTP answer."""
    try:
        fn()
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        return e.response
    raise AssertionError("the proxy accepted a bad request")


def _oai(proxy: Any, base: str | None = None, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base or proxy.v1, api_key="unused", max_retries=0, default_headers=headers or None)


def _ant(proxy: Any, base: str | None = None, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base or proxy.url, api_key="unused", max_retries=0,
                               default_headers=headers or None)


def chat(messages: list[dict[str, Any]] | None = None, model: str | None = None, base: str | None = None,
         headers: dict[str, str] | None = None, **kw: Any) -> Callable[[Any, str], httpx.Response]:
    def send(proxy: Any, served: str) -> httpx.Response:
        c = _oai(proxy, proxy.url + base if base else None, **(headers or {}))
        return _refused(lambda: c.chat.completions.create(
            model=model or served, messages=messages or [{"role": "user", "content": "hi"}], max_tokens=4, **kw))
    return send


def messages(msgs: list[dict[str, Any]] | None = None, model: str | None = None, base: str | None = None,
             headers: dict[str, str] | None = None, count: bool = False, **kw: Any) -> Callable[[Any, str], httpx.Response]:
    def send(proxy: Any, served: str) -> httpx.Response:
        c = _ant(proxy, proxy.url + base if base else None, **(headers or {}))
        m = msgs or [{"role": "user", "content": "hi"}]
        if count:
            return _refused(lambda: c.messages.count_tokens(model=model or served, messages=m, **kw))
        return _refused(lambda: c.messages.create(model=model or served, max_tokens=4, messages=m, **kw))
    return send


def responses(input: Any = "hi", model: str | None = None, base: str | None = None,
              headers: dict[str, str] | None = None, **kw: Any) -> Callable[[Any, str], httpx.Response]:
    def send(proxy: Any, served: str) -> httpx.Response:
        c = _oai(proxy, proxy.url + base if base else None, **(headers or {}))
        return _refused(lambda: c.responses.create(model=model or served, input=input, max_output_tokens=16, **kw))
    return send


def raw(method: str, path: str, *, json_body: Any = None, content: bytes | None = None,
        headers: dict[str, str] | None = None) -> Callable[[Any, str], httpx.Response]:
    def send(proxy: Any, served: str) -> httpx.Response:
        return httpx.request(method, proxy.url + path, json=json_body, content=content, headers=headers, timeout=30)
    return send


def feedback(**fields: Any) -> Callable[[Any, str], httpx.Response]:
    return raw("POST", "/atdp/v1/sessions/some-session/feedback", json_body={"reward": 1.0, **fields})


# --- the cases: every class of the issue, on every door / route it applies to ----------------------

TOOL_TURN = [{"role": "user", "content": "run it"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
ANT_TOOL_TURN = [{"role": "user", "content": "run it"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "f", "input": {}}]}]

CASES = [
    # 1. JSON nested 300 deep
    Bad("deep-json/chat", chat([{"role": "user", "content": DEEP}])),
    Bad("deep-json/messages", messages([{"role": "user", "content": DEEP}]), "anthropic"),
    Bad("deep-json/count_tokens", messages([{"role": "user", "content": DEEP}], count=True), "anthropic"),
    Bad("deep-json/responses", responses(DEEP)),
    Bad("deep-json/feedback", raw("POST", "/atdp/v1/sessions/x/feedback", json_body={"comment": DEEP})),
    Bad("deep-json/policy", raw("PUT", "/atdp/v1/tenants/acme/policy", json_body={"x": DEEP}, headers=ADMIN)),
    Bad("deep-json/versions", raw("POST", "/atdp/v1/versions", json_body={"checkpoint": DEEP}, headers=ADMIN)),
    # 2. tool_calls: "x"
    Bad("tool_calls-string/chat", chat([{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "ok", "tool_calls": "x"}])),
    # 3. stream_options: "x"
    Bad("stream_options-string/chat", chat(stream_options="x")),
    # 4. NUL in feedback fields (the feedback body's own 422)
    *[Bad(f"nul-feedback-{f}", feedback(**{f: NUL}), status=422)
      for f in ("comment", "correction", "source", "step_id", "idempotency_key")],
    # 5-8. NUL in session ids on GET / DELETE / close / feedback paths
    Bad("nul-session/get", raw("GET", "/atdp/v1/sessions/a%00" + MARK)),
    Bad("nul-session/delete", raw("DELETE", "/atdp/v1/sessions/a%00" + MARK)),
    Bad("nul-session/close", raw("POST", "/atdp/v1/sessions/a%00" + MARK + "/close")),
    Bad("nul-session/feedback", raw("POST", "/atdp/v1/sessions/a%00" + MARK + "/feedback", json_body={"reward": 1})),
    # 9. NUL in list filters
    *[Bad(f"nul-list-filter-{f}", raw("GET", f"/atdp/v1/sessions?{f}=a%00{MARK}", headers=ADMIN), status=422)
      for f in ("task_id", "status", "eligibility", "cursor")],
    Bad("nul-list-filter-tenant", raw("GET", f"/atdp/v1/sessions?tenant=a%00{MARK}", headers=ADMIN)),  # every route's tenant check
    Bad("nul-audit-filter", raw("GET", f"/atdp/v1/audit?actor=a%00{MARK}", headers=ADMIN)),
    Bad("nul-forget-reason", raw("DELETE", f"/atdp/v1/sessions/x?reason=a%00{MARK}")),
    Bad("nul-tenant-path/policy", raw("GET", f"/atdp/v1/tenants/a%00{MARK}/policy", headers=ADMIN)),
    Bad("nul-version-path/rollback", raw("POST", f"/atdp/v1/versions/a%00{MARK}/rollback", headers=ADMIN)),
    Bad("nul-checkpoint/versions", raw("POST", "/atdp/v1/versions", json_body={"checkpoint": NUL}, headers=ADMIN),
        status=422),
    # 10. NUL in previous_response_id
    Bad("nul-previous_response_id/responses", responses(previous_response_id=NUL)),
    # 11. a session id over 256 characters, from every place a door reads one
    Bad("long-session-header/chat", chat(headers={"x-atdp-session-id": LONG})),
    Bad("long-session-header/messages", messages(headers={"x-atdp-session-id": LONG}), "anthropic"),
    Bad("long-session-header/responses", responses(headers={"x-atdp-session-id": LONG})),
    Bad("long-session-path/chat", chat(base=f"/s/{LONG}/v1")),
    Bad("long-session-path/messages", messages(base=f"/s/{LONG}"), "anthropic"),
    Bad("long-session-path/responses", responses(base=f"/s/{LONG}/v1")),
    Bad("long-session-claude-code/messages", messages(headers={"x-claude-code-session-id": LONG}), "anthropic"),
    Bad("long-session-codex/responses", responses(headers={"session-id": LONG})),
    Bad("long-session-metadata/messages", messages(metadata={"user_id": json.dumps({"session_id": LONG})}),
        "anthropic"),
    Bad("long-session-client_metadata/responses", responses(extra_body={"client_metadata": {"session_id": LONG}})),
    Bad("long-task-id/chat", chat(headers={"x-atdp-task-id": LONG})),
    # 12. a model name over 256 characters
    Bad("long-model/chat", chat(model=LONG)),
    Bad("long-model/messages", messages(model=LONG), "anthropic"),
    Bad("long-model/count_tokens", messages(model=LONG, count=True), "anthropic"),
    Bad("long-model/responses", responses(model=LONG)),
    # 13. a NUL in an id (model, session in the path or the body, tool call ids)
    Bad("nul-model/chat", chat(model=NUL)),
    Bad("nul-model/messages", messages(model=NUL), "anthropic"),
    Bad("nul-model/responses", responses(model=NUL)),
    Bad("nul-session-path/chat", chat(base="/s/a%00" + MARK + "/v1")),
    Bad("nul-session-metadata/messages", messages(metadata={"user_id": json.dumps({"session_id": NUL})}),
        "anthropic"),
    Bad("nul-session-client_metadata/responses", responses(extra_body={"client_metadata": {"session_id": NUL}})),
    Bad("nul-tool_call_id/chat", chat([*TOOL_TURN, {"role": "tool", "tool_call_id": NUL, "content": "done"}])),
    Bad("nul-tool_use_id/messages", messages([*ANT_TOOL_TURN, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": NUL, "content": "done"}]}]), "anthropic"),
    Bad("nul-call_id/responses", responses([{"type": "function_call_output", "call_id": NUL, "output": "done"}])),
    # 14. a numeric tool call id
    Bad("numeric-tool_call_id/chat", chat([*TOOL_TURN, {"role": "tool", "tool_call_id": 5, "content": "done"}])),
    Bad("numeric-tool_calls-id/chat", chat([{"role": "user", "content": "run"}, {
        "role": "assistant", "tool_calls": [{"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])),
    Bad("numeric-tool_use_id/messages", messages([*ANT_TOOL_TURN, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": 5, "content": "done"}]}]), "anthropic"),
    Bad("numeric-call_id/responses", responses([{"type": "function_call_output", "call_id": 5, "output": "done"}])),
    # found by the fuzz test: a session id a response header cannot carry (it is echoed in one)
    Bad("non-ascii-session-path/responses", responses(base="/s/S%F2%AB%AE%98" + MARK + "/v1")),
    Bad("non-ascii-session-metadata/messages", messages(metadata={"user_id": json.dumps({"session_id": "sé" + MARK})}),
        "anthropic"),
    # 15. an over-long tool call id
    Bad("long-tool_call_id/chat", chat([*TOOL_TURN, {"role": "tool", "tool_call_id": LONG, "content": "done"}])),
]


def assert_api_error(r: httpx.Response, flavor: str, status: int) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    if flavor == "anthropic":
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == "invalid_request_error"
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    assert MARK not in r.text  # the field is named, its value never echoed


@pytest.fixture(scope="module")
def proxy(db_url, vllm_server, tmp_path_factory):
    """One proxy for the module (the cases only read it): in front of the real vLLM."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    settings = Settings(home=tmp_path_factory.mktemp("home"), database_url=db_url,
                        upstream_urls=[vllm_server.base_url], open_mode=True, default_tenant=tenant,
                        secret=b"test-secret", admin_key="admin-test-key", writer_mode="thread")
    app = create_app(settings, redactor=shared_redactor(settings.secret))
    server = ServerThread(app).start()
    try:
        wait_for_db(app.state.atdp)
        yield RunningProxy.of(app, server, tenant)
    finally:
        server.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_4xx_in_the_callers_shape(proxy, vllm_server, case):
    assert_api_error(case.send(proxy, vllm_server.model), case.flavor, case.status)


def test_nothing_bad_was_recorded_or_set_aside(proxy, vllm_server, factory):
    """After every case above (and the good calls below): no dead letter, no session with a bad id."""
    c = _oai(proxy)
    good = c.chat.completions.create(model=vllm_server.model, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, extra_headers={"x-atdp-session-id": "s" * 256})
    assert good.choices[0].message is not None  # the limit itself is fine
    r = _ant(proxy).messages.create(model=vllm_server.model, max_tokens=4, messages=[
        *ANT_TOOL_TURN, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "ok"}]}])
    assert r.type == "message"
    proxy.flush()
    assert deadletters.read(proxy.state.settings.spool_dir) == []
    with factory() as s:
        ids = list(s.scalars(select(t.Session.external_id).where(t.Session.tenant_id == proxy.tenant)))
    assert "s" * 256 in ids and not any(MARK in i for i in ids)
