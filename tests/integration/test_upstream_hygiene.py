"""The replica seam's hygiene: an error body that breaks mid-read frees the replica's in-flight slot
(so the next swap drains at once), and replica URLs never show their credentials."""

from __future__ import annotations

import logging
import socket

import anthropic
import httpx
import openai
import pytest

from proxy.store import db

ADMIN = {"authorization": "Bearer admin-test-key"}


@pytest.fixture
def own_db(new_database):
    url = new_database("atdp_hygiene")  # swaps register model versions, which are global
    db.upgrade(url)
    return url


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("status", [500, 400])
def test_error_body_read_failure_frees_the_slot_and_a_swap_drains(start_proxy, fake_upstream, own_db, status):
    # A drain that waited on a leaked slot would fail this swap after 5 s instead of waiting 120 s.
    proxy = start_proxy([fake_upstream.url], database_url=own_db, swap_drain_timeout_s=5.0)
    assert proxy.versions.ready.wait(30)
    replica = proxy.state.pool.replicas[0]
    chat = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        chat.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"#brokenerror {status}"}])
    assert err.value.status_code == 502 and "upstream" in err.value.message
    messages = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as aerr:
        messages.messages.create(model="fake", max_tokens=16,
                                 messages=[{"role": "user", "content": f"#brokenerror {status}"}])
    assert aerr.value.status_code == 502 and aerr.value.body["type"] == "error"  # Anthropic's error shape
    assert replica.inflight == 0
    replica.mark_alive()  # the 5xx path marked it dead for a second; the swap below does not care
    r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": "/ckpt/w1", "name": f"after-broken-{status}", "promote": "now"})
    assert r.status_code == 200, r.text
    listed = httpx.get(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=10).json()
    assert listed["serving"] == f"after-broken-{status}"
    # Both calls were recorded as failed steps, and traffic flows again.
    ok = chat.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hello"}])
    assert ok.choices[0].message.content == "[w1] echo: hello"


def test_credentials_in_replica_urls_never_shown(start_proxy, fake_upstream, factory, caplog):
    secret_user, secret_pw, token = "opsuser", "s3cretPW", "tok-abc123"
    port = fake_upstream.url.rsplit(":", 1)[1]
    live = f"http://{secret_user}:{secret_pw}@127.0.0.1:{port}"
    dead = f"http://{secret_user}:{secret_pw}@127.0.0.1:{_dead_port()}"
    dead_query = f"http://127.0.0.1:{_dead_port()}/?token={token}"
    caplog.set_level(logging.DEBUG)
    proxy = start_proxy([live, dead, dead_query])
    shown: list[str] = []
    # Calls spread over the replicas (rendezvous by session); dead ones fail over to the live one.
    for i in range(6):
        r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": f"cred-{i}"}, timeout=30,
                       json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    health = httpx.get(proxy.url + "/healthz")
    shown += [health.text, httpx.get(proxy.url + "/metrics").text,
              httpx.get(proxy.url + "/atdp/v1/versions", headers=ADMIN).text]
    assert f"127.0.0.1:{port}" in health.text  # the replica is still named, by host and port
    # Only dead replicas: the 502 names them, without credentials, in both doors' formats.
    down = start_proxy([dead, dead_query])
    r = httpx.post(down.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 502 and "127.0.0.1" in r.json()["error"]["message"]
    shown.append(r.text)
    r = httpx.post(down.url + "/v1/messages", json={"model": "fake", "max_tokens": 8,
                                                    "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 502 and r.json()["type"] == "error"
    shown.append(r.text)
    shown += [s.upstream or "" for s in proxy.steps(factory) + down.steps(factory)]
    shown += [str((s.error or {}).get("message")) for s in down.steps(factory)]
    # The proxy's own logs (`atdp serve` keeps httpx's per-request INFO lines off: WARNING).
    shown += [rec.getMessage() for rec in caplog.records if rec.name.startswith("atdp")]
    assert any("could not sync the weight version" in m for m in shown)  # a log line that names a replica
    for text in shown:
        assert secret_pw not in text and token not in text and f"{secret_user}:" not in text, text[:500]
