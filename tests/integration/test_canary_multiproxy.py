"""A canary begun on one proxy routes sessions by its arms on every proxy (issue 17, item 1).

Two proxies share one database and two scripted replicas. Proxy A begins the canary (the first
replica serves the candidate); proxy B learns of it from the swap channel. Sessions start on B and
continue on both: each is assigned once (by whichever proxy served its first call) and every one of
its calls, on either proxy, is served by its arm's version. B monitors it too, and a third proxy
started meanwhile resumes it: each routes, and each monitor waits for the monitor lock A holds (one
decides). An operator's rollback sent to B ends the canary everywhere: every proxy stops routing,
every monitor stops, the group gets its weights back.

And when the proxy that began a canary goes away for good (a replica scaled down), a proxy that only
heard of it takes the monitor lock and decides it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from sqlalchemy import select

from proxy.rollout import canary
from proxy.store import tables as t
from tests.fake_vllm import FakeVLLM, ServerThread

ADMIN = {"authorization": "Bearer admin-test-key"}


def _call(proxy, sid: str, turn: int) -> None:
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": sid}, timeout=30,
                   json={"model": "fake", "messages": [{"role": "user", "content": f"{sid} turn {turn}"}],
                         "max_tokens": 4})
    assert r.status_code == 200, r.text


def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _canary_on_a(start_proxy, servers, opts: dict):
    """Proxies A and B on the same replicas, both listening; A begins the canary of `cand`: (a, b, id)."""
    a = start_proxy([s.url for s in servers], **opts)
    b = start_proxy([s.url for s in servers], **opts)
    assert a.versions.ready.wait(30) and b.versions.ready.wait(30)
    _until(lambda: all(p.versions.bus is not None and p.versions.bus.ready.is_set() for p in (a, b)),
           "swap listeners never ready")
    r = httpx.post(a.url + "/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": "/ckpt/cand", "name": "cand", "wait": True})
    assert r.json()["status"] == "canary", r.text
    return a, b, r.json()["id"]


def test_canary_begun_on_one_proxy_routes_on_the_other(start_proxy, own_db):
    url, factory = own_db
    fakes = [FakeVLLM(), FakeVLLM()]
    servers = [ServerThread(f).start() for f in fakes]
    try:
        opts = {"database_url": url, "canary_fraction": 0.5, "canary_check_s": 0.5, "tenant": "t-canary2",
                # No decision during the test: the operator ends it.
                "canary_promote_margin": 0.0, "canary_error_rise": 1.0, "canary_tool_failure_rise": 1.0}
        a, b, vid = _canary_on_a(start_proxy, servers, opts)
        _until(lambda: b.state.canary.active is not None, "proxy B never learned of the canary")
        assert b.state.canary.active.version_id == vid
        _until(lambda: b.versions.canary_task is not None, "proxy B never monitored the canary")
        standby = b.versions.canary_task
        # B's start-up resume may run after B heard of the canary (it polls every 0.5 s): it starts no
        # second monitor.
        asyncio.run(canary.resume(b.state, b.versions))
        assert b.versions.canary_task is standby
        assert [rep.version for rep in b.state.pool.replicas] == ["cand", "base"]
        c = start_proxy([s.url for s in servers], **opts)  # started during the canary: resumes it
        assert c.versions.ready.wait(30)
        _until(lambda: c.versions.canary_task is not None, "proxy C never resumed the canary")
        assert c.state.canary.active is not None and c.state.canary.active.version_id == vid

        sids = [f"s{i}" for i in range(12)]
        for sid in sids:  # first calls on B: B assigns the arms
            _call(b, sid, 0)
        for turn in range(1, 4):  # then every session on every proxy
            for k, sid in enumerate(sids):
                _call((a, b, c)[(k + turn) % 3], sid, turn)
        for p in (a, b, c):
            p.flush()
        assert not standby.done() and not c.versions.canary_task.done()  # waiting for the lock A holds
        with factory() as s:
            arms = dict(s.execute(select(t.CanarySession.session_id, t.CanarySession.arm)
                                  .where(t.CanarySession.version_id == vid)).all())
            served = s.execute(select(t.Session.external_id, t.Step.model_version)
                               .join(t.Step, t.Step.session_id == t.Session.id)
                               .where(t.Session.tenant_id == "t-canary2")).all()
        assert set(arms) == set(sids) and set(arms.values()) == {"candidate", "serving"}
        versions: dict[str, set[str]] = {}
        for sid, version in served:
            versions.setdefault(sid, set()).add(version)
        assert {sid: versions[sid] for sid in sids} == {
            sid: {"cand" if arms[sid] == "candidate" else "base"} for sid in sids}

        back = httpx.post(b.url + "/atdp/v1/versions/cand/rollback", headers=ADMIN, timeout=60)
        assert back.status_code == 200 and back.json()["status"] == "rolled_back", back.text
        _until(lambda: a.state.canary.active is None, "proxy A kept routing after the rollback")
        _until(lambda: c.state.canary.active is None, "proxy C kept routing after the rollback")
        for p in (a, b, c):
            _until(lambda p=p: p.versions.canary_task.done(), "a monitor went on")
        assert fakes[0].weights == "fake" and b.state.canary.active is None
        assert [rep.version for p in (a, b, c) for rep in p.state.pool.replicas] == ["base"] * 6
        with factory() as s:
            assert s.get(t.Canary, vid).decision == "rolled_back"
    finally:
        for s in servers:
            s.stop()


def test_a_proxy_that_only_heard_of_the_canary_decides_it_once_its_beginner_is_gone(start_proxy, own_db):
    url, factory = own_db
    fakes = [FakeVLLM(), FakeVLLM()]
    servers = [ServerThread(f).start() for f in fakes]
    try:
        opts = {"database_url": url, "canary_fraction": 0.5, "canary_check_s": 0.2, "canary_promote_margin": 0.3,
                "tenant": "t-canary-gone"}
        a, b, vid = _canary_on_a(start_proxy, servers, opts)
        _until(lambda: b.versions.canary_task is not None, "proxy B never monitored the canary")
        a.server.stop()  # the proxy that began it goes for good: its monitor lock goes with its connection
        n = 0
        status = "canary"
        while status == "canary" and n < 200:  # both arms rewarded alike, on B, until B's monitor promotes
            sid = f"r{n}"
            _call(b, sid, 0)
            b.flush()
            fb = httpx.post(f"{b.url}/atdp/v1/sessions/{sid}/feedback", json={"reward": 1.0}, timeout=30)
            assert fb.status_code in (200, 201), fb.text
            status = httpx.get(b.url + "/atdp/v1/versions/cand", headers=ADMIN, timeout=30).json()["status"]
            n += 1
        assert status == "serving", n
        assert b.versions.canary_task.done() and b.state.canary.active is None
        assert [f.weights for f in fakes] == ["cand", "cand"]
        with factory() as s:
            row = s.get(t.Canary, vid)
            assert row.decision == "promoted" and row.decided_at is not None
    finally:
        for s in servers:
            s.stop()
