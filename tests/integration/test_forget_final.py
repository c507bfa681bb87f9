"""Forget is final (#13): a forgotten session never comes back.

Its steps that were spooled (or re-sent by the writer) when the forget ran are refused by the
tombstone the forget leaves; its pending spool records are purged; the continuation index and the
Responses door's recent conversations no longer link new calls to it. A client that reuses the
session id after the forget records new data, as a new session.
"""

from __future__ import annotations

import shutil
import time

import httpx
import openai
from sqlalchemy import String, select

from proxy.store import tables as t


def _chat(proxy, content: str, *, session: str | None = None, history: list | None = None) -> tuple[list, str]:
    messages = [*(history or []), {"role": "user", "content": content}]
    r = httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": messages}, timeout=30,
                   headers={"x-atdp-session-id": session} if session else {})
    assert r.status_code == 200, r.text
    return [*messages, r.json()["choices"][0]["message"]], r.headers["x-atdp-session-id"]


def _steps(factory, tenant: str, external_id: str) -> int:
    with factory() as s:
        return len(s.scalars(select(t.Step.id).join(t.Session, t.Session.id == t.Step.session_id)
                             .where(t.Session.tenant_id == tenant, t.Session.external_id == external_id)).all())


def _contents_saying(factory, tenant: str, words: str) -> int:
    with factory() as s:
        return len(s.scalars(select(t.Content.hash).where(t.Content.tenant_id == tenant,
                                                          t.Content.body.cast(String).contains(words))).all())


def _wait_drained(proxy, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while proxy.state.recorder.spool.pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not proxy.state.recorder.spool.pending(), "the spool did not drain"


def test_spooled_steps_of_a_forgotten_session_are_not_reinserted(start_proxy, fake_upstream, factory, tmp_path):
    home = tmp_path / "home"
    down = start_proxy([fake_upstream.url], database_url="postgresql://postgres@127.0.0.1:1/nowhere", home=home,
                       wait_db=False)
    for i in range(3):
        _chat(down, f"gone {i}", session="gone")
    for i in range(2):
        _chat(down, f"kept {i}", session="kept")
    down.flush()
    down.server.stop()
    segments = sorted((home / "spool").glob("*.jsonl"))
    assert sum(len(p.read_bytes().splitlines()) for p in segments) == 5
    # A copy of what was spooled: replayed after the forget, as a writer re-sending an unacknowledged
    # batch or a second spool drained late would.
    aside = tmp_path / "aside"
    aside.mkdir()
    for p in segments:
        shutil.copy(p, aside / p.name)

    up = start_proxy([fake_upstream.url], home=home, tenant=down.tenant)
    _wait_drained(up)
    assert (_steps(factory, up.tenant, "gone"), _steps(factory, up.tenant, "kept")) == (3, 2)
    assert _contents_saying(factory, up.tenant, "gone 1") == 3  # the user's message, the answer, its output
    r = httpx.delete(f"{up.url}/atdp/v1/sessions/gone", timeout=30)
    assert r.status_code == 200 and r.json()["steps"] == 3, r.text
    assert _contents_saying(factory, up.tenant, "gone 1") == 0

    for p in aside.iterdir():
        shutil.copy(p, home / "spool" / p.name)
    _wait_drained(up)
    assert _steps(factory, up.tenant, "gone") == 0  # the tombstone refused them
    assert _contents_saying(factory, up.tenant, "gone 1") == 0  # and what they said
    assert _steps(factory, up.tenant, "kept") == 2

    # The client keeps using the id after the forget: that is new data, recorded as a new session.
    _chat(up, "after the forget", session="gone")
    up.flush()
    assert _steps(factory, up.tenant, "gone") == 1


def test_forget_purges_the_pending_spool_records_of_the_session(start_proxy, fake_upstream, tmp_path):
    home = tmp_path / "home"
    down = start_proxy([fake_upstream.url], database_url="postgresql://postgres@127.0.0.1:1/nowhere", home=home,
                       wait_db=False)
    for i in range(3):
        _chat(down, f"gone {i}", session="gone")
    _chat(down, "kept", session="kept")
    down.flush()
    # The writer is told (as the forget route tells it once the database has deleted the rows).
    down.state.recorder.forget(down.tenant, step_ids=[], content_hashes=[], sessions=["gone"])
    lines = [ln for p in sorted((home / "spool").glob("*.jsonl")) for ln in p.read_bytes().splitlines()]
    assert len(lines) == 1 and b'"kept"' in lines[0] and b'"gone"' not in lines[0]


def test_no_new_call_links_to_a_forgotten_session(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    history, sid = _chat(proxy, "#say hello there")  # no session id: the proxy names the session
    follow, same = _chat(proxy, "and then?", history=history)
    assert same == sid  # continuation links the follow-up
    proxy.flush()
    assert httpx.delete(f"{proxy.url}/atdp/v1/sessions/{sid}", timeout=30).status_code == 200
    _, after = _chat(proxy, "still there?", history=follow)
    assert after != sid  # the continuation index let go of the forgotten transcript
    proxy.flush()
    assert _steps(factory, proxy.tenant, sid) == 0

    # The Responses door's recent conversations: a previous_response_id of the forgotten session
    # is no longer found (memory would otherwise answer for 10 minutes).
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    r1 = client.responses.create(model="fake", input="remember the word plum")
    proxy.response_store.flush()
    proxy.flush()
    with factory() as s:
        session = s.scalar(select(t.Session.external_id).join(t.Step, t.Step.session_id == t.Session.id)
                           .where(t.Step.tenant_id == proxy.tenant, t.Step.api == "responses"))
    assert httpx.delete(f"{proxy.url}/atdp/v1/sessions/{session}", timeout=30).status_code == 200
    r = httpx.post(proxy.v1 + "/responses", json={"model": "fake", "previous_response_id": r1.id, "input": "and?"},
                   timeout=30)
    assert r.status_code == 404, r.text
