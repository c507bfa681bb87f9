"""A forget reaches every proxy on the database (issue 17, "many proxies, one truth").

A forget (session, tenant, retention) deletes rows once, on whichever proxy (or `atdp forget`) ran it,
but every proxy's memory holds what it saw: its writer's "already stored" contents, its continuation
keys, its spool and dead letters. Before the announcement, a proxy that had not run the forget kept
believing the deleted contents stored: its next call with the same system prompt wrote a step whose
content rows did not exist (the transcript could not be rebuilt). Now the forget is announced on the
proxies' channel in its own transaction, and each proxy lets go of the same things the one that ran
it does. A tenant's policy change is announced the same way, so no writer keeps the old one.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
from sqlalchemy import select, text

from proxy.governance import forget
from proxy.governance.policy import TenantPolicy
from proxy.record import deadletters
from proxy.store import tables as t
from proxy.store.notes import NOTIFY

ADMIN = {"authorization": "Bearer admin-test-key"}


def _chat(proxy, system: str, content: str, session: str) -> None:
    r = httpx.post(proxy.v1 + "/chat/completions", timeout=30, headers={"x-atdp-session-id": session},
                   json={"model": "fake", "messages": [{"role": "system", "content": system},
                                                       {"role": "user", "content": content}]})
    assert r.status_code == 200, r.text


def _missing_contents(factory, tenant: str, session: str) -> list[str]:
    """Content hashes the session's steps refer to that no content row holds."""
    with factory() as s:
        steps = s.scalars(select(t.Step).join(t.Session, t.Session.id == t.Step.session_id)
                          .where(t.Session.tenant_id == tenant, t.Session.external_id == session)).all()
        assert steps, f"no step of {session}"
        refs = {h for st in steps for h in (st.system_hash, st.output_hash, *st.message_hashes) if h}
        have = set(s.scalars(select(t.Content.hash).where(t.Content.tenant_id == tenant, t.Content.hash.in_(refs))))
    return sorted(refs - have)


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the other proxy never heard of the forget"
        time.sleep(0.02)


def _knows(proxy) -> int:
    return proxy.state.recorder.health().caches["contents_known"]


def test_a_tenant_forgotten_on_one_proxy_is_forgotten_by_every_proxy(start_proxy, fake_upstream, factory):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a, b = (start_proxy([fake_upstream.url], tenant=tenant, shared_links=True) for _ in range(2))
    _until(lambda: all(p.versions.bus is not None and p.versions.bus.ready.is_set() for p in (a, b)))
    system = f"You are agent {uuid.uuid4().hex[:6]}."
    _chat(b, system, "list the files", "first")
    b.flush()
    assert _knows(b) > 0
    r = httpx.delete(f"{a.url}/atdp/v1/tenants/{tenant}", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["contents"] >= 3
    _until(lambda: _knows(b) == 0)  # b's writer no longer believes the tenant's contents stored
    # The same system prompt and question again, through the proxy that did not run the forget.
    _chat(b, system, "list the files", "second")
    b.flush()
    assert _missing_contents(factory, tenant, "second") == []


def test_a_session_forgotten_on_one_proxy_leaves_no_dead_letters_or_links_on_another(start_proxy, fake_upstream,
                                                                                     factory):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a, b = (start_proxy([fake_upstream.url], tenant=tenant, shared_links=True) for _ in range(2))
    _until(lambda: all(p.versions.bus is not None and p.versions.bus.ready.is_set() for p in (a, b)))
    system = f"You are agent {uuid.uuid4().hex[:6]}."
    _chat(b, system, "the secret plan", "gone")
    _chat(b, system, "another question", "kept")
    b.flush()
    # A dead letter of the session in b's own spool folder (a step the database once refused).
    [step] = [st for st in b.steps(factory, "gone")]
    letter = {"kind": "step", "id": str(uuid.uuid4()), "session": {"tenant_id": tenant, "external_id": "gone"},
              "started_at": step.started_at.isoformat()}
    b.state.recorder.spool.reject([letter], reason="test")
    assert [x.session for x in deadletters.read(b.state.settings.spool_dir)] == ["gone"]
    known_before = _knows(b)

    r = httpx.delete(f"{a.url}/atdp/v1/sessions/gone", headers=ADMIN, params={"tenant": tenant}, timeout=30)
    assert r.status_code == 200, r.text
    gone = r.json()
    assert gone["steps"] == 1 and gone["contents"] >= 2  # its question and answer (the system prompt is shared)
    _until(lambda: not deadletters.read(b.state.settings.spool_dir))
    assert _knows(b) == known_before - gone["contents"]  # exactly the deleted contents, no more
    _chat(b, system, "the secret plan", "again")
    b.flush()
    assert _missing_contents(factory, tenant, "again") == []
    assert _missing_contents(factory, tenant, "kept") == []


def test_a_forget_from_the_command_line_reaches_running_proxies(start_proxy, fake_upstream, factory):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    p = start_proxy([fake_upstream.url], tenant=tenant)
    _until(lambda: p.versions.bus is not None and p.versions.bus.ready.is_set())
    system = f"You are agent {uuid.uuid4().hex[:6]}."
    _chat(p, system, "what is in src/", "cli")
    p.flush()
    with factory() as s, s.begin():  # what `atdp forget --session` runs, outside any proxy
        report = forget.forget_session(s, "cli", tenant=tenant, actor="cli")
    assert report is not None and report.contents >= 3
    _until(lambda: _knows(p) == 0)
    _chat(p, system, "what is in src/", "cli-again")
    p.flush()
    assert _missing_contents(factory, tenant, "cli-again") == []


def test_retention_run_elsewhere_reaches_running_proxies(start_proxy, fake_upstream, own_db):
    url, factory = own_db  # retention here drops day partitions: a database of the test's own
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    p = start_proxy([fake_upstream.url], tenant=tenant, database_url=url)
    _until(lambda: p.versions.bus is not None and p.versions.bus.ready.is_set())
    system = f"You are agent {uuid.uuid4().hex[:6]}."
    _chat(p, system, "an old question", "old")
    p.flush()
    known = _knows(p)
    with factory() as s, s.begin():  # what `atdp retention` runs, three days later
        [report] = forget.run_retention(s, policy_for=lambda s, tn: TenantPolicy(retention_days=1),
                                        now=datetime.now(UTC) + timedelta(days=3), quiet_s=0.0)
    assert report.tenant == tenant and report.steps == 1 and report.contents >= 3
    _until(lambda: _knows(p) == known - report.contents)
    _chat(p, system, "an old question", "new")
    p.flush()
    assert _missing_contents(factory, tenant, "new") == []


def test_a_policy_changed_on_one_proxy_applies_at_once_on_another(start_proxy, fake_upstream, factory):
    """Writers cache a tenant's policy for 10 s; a change is announced when it commits, and every
    proxy's writer reads it again for its next step."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a, b = (start_proxy([fake_upstream.url], tenant=tenant) for _ in range(2))
    _until(lambda: all(p.versions.bus is not None and p.versions.bus.ready.is_set() for p in (a, b)))
    _chat(b, "You are an agent.", "first", "before")
    b.flush()
    assert tenant in b.state.recorder.preparer._policies  # b's writer holds the tenant's policy now
    r = httpx.put(f"{a.url}/atdp/v1/tenants/{tenant}/policy", headers=ADMIN, json={"training_consent": False})
    assert r.status_code == 200, r.text
    _until(lambda: tenant not in b.state.recorder.preparer._policies)
    _chat(b, "You are an agent.", "second", "after")
    [before], [after] = b.steps(factory, "before"), b.steps(factory, "after")
    assert (before.eligibility, after.eligibility) == ("eligible", "audit_only")
    assert after.eligibility_reason == "no training consent"


def test_a_large_forget_is_announced_in_notes_postgresql_accepts(factory):
    """PostgreSQL refuses a NOTIFY payload of 8,000 bytes or more: a forget of many steps and contents is
    announced in several notes, each under the limit, together naming every id once."""
    report = forget.Forgotten(tenant="t-" + "x" * 120, step_ids=[str(uuid.uuid4()) for _ in range(900)],
                              content_hashes=[uuid.uuid4().hex * 2 for _ in range(700)],
                              external_ids=[f"s-{i}-" + "y" * 200 for i in range(40)])
    notes = forget.announcement(report, origin="me")
    with factory() as s:
        for note in notes:
            s.execute(NOTIFY, {"payload": note})  # PostgreSQL checks the size as it queues the note
        s.rollback()
    assert len(notes) > 5
    assert all(len(n.encode()) < 8000 for n in notes)
    parsed = [json.loads(n) for n in notes]
    assert {p["tenant"] for p in parsed} == {report.tenant} and {p["from"] for p in parsed} == {"me"}
    assert sorted(x for p in parsed for x in p["steps"]) == sorted(report.step_ids)
    assert sorted(x for p in parsed for x in p["contents"]) == sorted(report.content_hashes)
    assert sorted(x for p in parsed for x in p["sessions"]) == sorted(report.external_ids)


def test_a_listener_that_reconnects_stops_trusting_what_it_believed_stored(start_proxy, fake_upstream, factory):
    """Notes sent while a proxy's listener was away are lost to it: on reconnecting, its writer
    forgets which contents it believed stored, so none it may have missed a forget of is referred to."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    p = start_proxy([fake_upstream.url], tenant=tenant)
    _until(lambda: p.versions.bus is not None and p.versions.bus.ready.is_set())
    _chat(p, f"You are agent {uuid.uuid4().hex[:6]}.", "hello", "before")
    p.flush()
    assert _knows(p) > 0
    with factory() as s, s.begin():
        killed = s.scalar(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                               "WHERE query = 'LISTEN atdp_swaps' AND pid <> pg_backend_pid()"))
    assert killed >= 1
    _until(lambda: not p.versions.bus.ready.is_set() or _knows(p) == 0)
    _until(lambda: p.versions.bus.ready.is_set() and _knows(p) == 0)
