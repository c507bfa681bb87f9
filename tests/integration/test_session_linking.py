"""Independent runs stay separate (issues 13, 43): a client that names no session (Hermes) has its
calls grouped by continuation only. A call that repeats an earlier request is that request's retry
(same session) only when the earlier call delivered no answer, or when the client says it retries
(the SDKs' `x-stainless-retry-count`); two runs that open with the same words are two sessions,
however close together, and each one's next turn joins its own run. Official SDKs as clients,
a scripted upstream for the failures, real PostgreSQL."""

from __future__ import annotations

import time
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

from proxy.auth import create_key
from proxy.store.db import transaction

SYSTEM = "You are the repository's coding agent. Follow AGENTS.md."
FIRST = {"role": "user", "content": "fix the failing test in tests/test_io.py"}
HERMES = {"User-Agent": "HermesAgent/0.4 (python)"}  # sends no session id


@dataclass
class Reply:
    text: str
    session: str
    step: str


def ask(sdk: str, proxy, messages: list[dict], *, key: str = "unused-in-open-mode", max_retries: int = 0,
        timeout: float = 30.0, **extra) -> Reply:
    """One call through the official SDK `sdk` ("openai": chat completions, "anthropic": messages)."""
    if sdk == "openai":
        client = openai.OpenAI(base_url=proxy.v1, api_key=key, max_retries=max_retries, timeout=timeout,
                               default_headers=HERMES)
        raw = client.chat.completions.with_raw_response.create(
            model="fake", messages=[{"role": "system", "content": SYSTEM}, *messages], **extra)
        text = raw.parse().choices[0].message.content or ""
    else:
        aclient = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=max_retries, timeout=timeout,
                                      default_headers=HERMES)
        raw = aclient.messages.with_raw_response.create(model="fake", max_tokens=256, system=SYSTEM,
                                                        messages=messages, **extra)
        text = raw.parse().content[0].text
    return Reply(text, raw.headers["x-atdp-session-id"], raw.headers["x-atdp-step-id"])


def next_turn(messages: list[dict], reply: Reply, words: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply.text}, {"role": "user", "content": words}]


def parents(proxy, factory, session: str) -> list[tuple[str, str | None, str]]:
    """(step, parent step, status) of a session's steps, in order."""
    return [(s.id, s.parent_step_id, s.status) for s in proxy.steps(factory, session)]


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_two_runs_opening_alike_a_second_apart_are_two_sessions(start_proxy, fake_upstream, factory, sdk):
    proxy = start_proxy([fake_upstream.url])  # the default retry window, 30 s
    fake_upstream.script = [{"text": "run A: reading tests/test_io.py"}, {"text": "run B: running pytest"}]
    a = ask(sdk, proxy, [FIRST])
    time.sleep(1.0)
    b = ask(sdk, proxy, [FIRST])  # the same body, after A's answer was delivered: another run
    assert b.session != a.session
    a2 = ask(sdk, proxy, next_turn([FIRST], a, "go on"))
    b2 = ask(sdk, proxy, next_turn([FIRST], b, "go on"))
    assert (a2.session, b2.session) == (a.session, b.session)
    assert parents(proxy, factory, a.session) == [(a.step, None, "ok"), (a2.step, a.step, "ok")]
    assert parents(proxy, factory, b.session) == [(b.step, None, "ok"), (b2.step, b.step, "ok")]


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_an_sdk_retry_after_a_failed_attempt_is_one_session(start_proxy, fake_upstream, factory, sdk):
    """The upstream fails the first attempt (the proxy answers 502/503); the SDK retries with
    `x-stainless-retry-count: 1`; the retry joins the failed attempt's session."""
    proxy = start_proxy([fake_upstream.url])
    fake_upstream.script = [{"status": 500}]
    r = ask(sdk, proxy, [FIRST], max_retries=3)
    steps = proxy.steps(factory, r.session)
    assert [s.status for s in steps][0] == "error" and steps[-1].id == r.step and steps[-1].status == "ok"
    assert all(s.parent_step_id is None for s in steps)
    # The run goes on from the retry's answer, in the same session.
    r2 = ask(sdk, proxy, next_turn([FIRST], r, "go on"))
    assert r2.session == r.session
    assert parents(proxy, factory, r.session)[-1] == (r2.step, r.step, "ok")


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_an_sdk_retry_after_its_timeout_joins_the_attempt_still_running(start_proxy, fake_upstream, factory, sdk):
    """The first attempt hangs past the SDK's timeout; the SDK gives up on it and retries while the
    proxy still waits on the upstream: one session, and the next turn continues the retry's answer."""
    proxy = start_proxy([fake_upstream.url])
    fake_upstream.script = [{"delay": 3.0, "text": "the slow first attempt"}, {"text": "the retry's answer"}]
    r = ask(sdk, proxy, [FIRST], max_retries=1, timeout=1.0)
    assert r.text.endswith("the retry's answer")
    time.sleep(2.5)  # the first attempt ends (its answer reaches nobody)
    r2 = ask(sdk, proxy, next_turn([FIRST], r, "go on"))
    assert r2.session == r.session
    steps = parents(proxy, factory, r.session)
    assert len(steps) == 3 and [p for _, p, _ in steps] == [None, None, r.step]
    assert steps[-1][0] == r2.step


def test_a_plain_client_resending_after_a_failure_is_a_retry_and_after_an_answer_a_new_run(
        start_proxy, fake_upstream):
    """A client with no retry signal (its own retry loop, as an agent framework has): the same body
    again after an error joins the failed call's session; after an answer it is a new run."""
    proxy = start_proxy([fake_upstream.url], retry_window_s=2.0)
    body = {"model": "fake", "messages": [{"role": "system", "content": SYSTEM}, FIRST]}

    def post() -> httpx.Response:
        return httpx.post(proxy.v1 + "/chat/completions", json=body, headers=HERMES, timeout=30)

    fake_upstream.script = [{"status": 500}]
    failed = post()
    assert failed.status_code >= 500
    time.sleep(1.1)  # the replica is marked down for a second after its 500
    ok = post()
    assert ok.status_code == 200 and ok.headers["x-atdp-session-id"] == failed.headers["x-atdp-session-id"]
    again = post()
    assert again.status_code == 200 and again.headers["x-atdp-session-id"] != ok.headers["x-atdp-session-id"]
    # With the client's retry signal, the same body joins even an answered call (its answer may
    # have been lost on the way) ...
    signalled = httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=30,
                           headers={**HERMES, "x-stainless-retry-count": "1"})
    assert signalled.headers["x-atdp-session-id"] == again.headers["x-atdp-session-id"]
    # ... within the retry window only.
    time.sleep(2.1)
    late = httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=30,
                      headers={**HERMES, "x-stainless-retry-count": "1"})
    assert late.headers["x-atdp-session-id"] not in {again.headers["x-atdp-session-id"], ok.headers["x-atdp-session-id"]}


def test_an_idempotency_key_names_the_request_it_retries(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0, default_headers=HERMES)

    def call(key: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="fake", messages=[{"role": "system", "content": SYSTEM}, FIRST],
            extra_headers={"Idempotency-Key": key})
        return raw.headers["x-atdp-session-id"]

    first = call("req-1")
    assert call("req-1") == first  # the same request again
    assert call("req-2") != first  # another request that happens to say the same


def test_different_keys_or_end_users_never_merge(start_proxy, fake_upstream, factory):
    """Two keys (or two end users) whose runs open alike and are answered alike (a greedy model):
    even with a retry signal after a failed attempt, and on every next turn, each stays its own."""
    proxy = start_proxy([fake_upstream.url], open_mode=False)
    with transaction(factory) as s:
        keys = [create_key(s, proxy.tenant)[1] for _ in range(2)]
    fake_upstream.script = [{"status": 500}]
    with pytest.raises(openai.APIStatusError):
        ask("openai", proxy, [FIRST], key=keys[0])
    time.sleep(1.1)  # the replica is marked down for a second after its 500
    # The other key's first call, as an SDK retry would send it: not the failed call's retry.
    b = ask("openai", proxy, [FIRST], key=keys[1], extra_headers={"x-stainless-retry-count": "1"})
    a = ask("openai", proxy, [FIRST], key=keys[0], extra_headers={"x-stainless-retry-count": "1"})
    assert a.session != b.session and a.text == b.text
    assert ask("openai", proxy, next_turn([FIRST], a, "go on"), key=keys[0]).session == a.session
    assert ask("openai", proxy, next_turn([FIRST], b, "go on"), key=keys[1]).session == b.session
    # End users of one key (OpenAI `user`, Anthropic `metadata.user_id`) likewise.
    for sdk, who in (("openai", lambda u: {"user": u}), ("anthropic", lambda u: {"metadata": {"user_id": u}})):
        u1 = ask(sdk, proxy, [FIRST], key=keys[0], **who("u1"))
        u2 = ask(sdk, proxy, [FIRST], key=keys[0], **who("u2"))
        assert u1.session != u2.session and u1.text == u2.text
        assert ask(sdk, proxy, next_turn([FIRST], u1, "go on"), key=keys[0], **who("u1")).session == u1.session
        assert ask(sdk, proxy, next_turn([FIRST], u2, "go on"), key=keys[0], **who("u2")).session == u2.session
