"""Gate 3's bookkeeping on PostgreSQL with two scripted engines (tests/fake_vllm.py): what the real
engines add nothing to (tests/integration/test_canary_vllm.py has the real-engine runs).

- the assignment lives in PostgreSQL: a proxy restarted mid-canary keeps every session on its arm,
  stamps the canary's replica with the candidate again and resumes the decision;
- a tenant named in `canary_tenants` sends all its new sessions to the candidate;
- while a canary runs, the override and a rollback of the serving version answer 409; an operator's
  rollback of the canary ends it (its group gets the serving weights back);
- with a single replica there is no second group: the `canary` gate is `skipped`, the version promoted.
Rewards are posted by the tests through the feedback API.
"""

from __future__ import annotations

import httpx
from sqlalchemy import select

from proxy.store import tables as t
from tests.fake_vllm import FakeVLLM, ServerThread

ADMIN = {"authorization": "Bearer admin-test-key"}


def _call(proxy, sid: str) -> httpx.Response:
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": sid}, timeout=30,
                   json={"model": "fake", "messages": [{"role": "user", "content": f"hi {sid}"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r


def _post(proxy, body: dict) -> httpx.Response:
    return httpx.post(proxy.url + "/atdp/v1/versions", json=body, headers=ADMIN, timeout=60)


def _served(proxy, factory, sid: str) -> set[str]:
    return {s.model_version for s in proxy.steps(factory, sid)}


def _arms(factory, version_id: str) -> dict[str, str]:
    with factory() as s:
        return dict(s.execute(select(t.CanarySession.session_id, t.CanarySession.arm)
                              .where(t.CanarySession.version_id == version_id)).all())


def _two_fakes():
    a, b = FakeVLLM(), FakeVLLM()
    sa, sb = ServerThread(a).start(), ServerThread(b).start()
    return (a, sa), (b, sb)


def test_assignment_survives_a_restart_and_the_canary_resumes(start_proxy, own_db, tmp_path):
    url, factory = own_db
    (a, sa), (b, sb) = _two_fakes()
    try:
        upstreams = [sa.url, sb.url]
        opts = {"database_url": url, "canary_fraction": 0.5, "canary_check_s": 0.2, "canary_promote_margin": 0.3,
                "tenant": "t-restart", "home": tmp_path / "home"}
        proxy = start_proxy(upstreams, **opts)
        assert proxy.versions.ready.wait(30)
        _call(proxy, "old")  # began (and was stored) before the canary
        proxy.flush()
        r = _post(proxy, {"checkpoint": "/ckpt/cand", "name": "cand", "wait": True})
        assert r.json()["status"] == "canary", r.text
        vid = r.json()["id"]
        assert (a.weights, a.version) == ("cand", "cand") and b.version == "base"  # group: the first replica
        for i in range(12):
            _call(proxy, f"s{i}")
        _call(proxy, "old")
        proxy.flush()
        before = _arms(factory, vid)
        assert before["old"] == "before" and {before[f"s{i}"] for i in range(12)} == {"candidate", "serving"}
        proxy.server.stop()

        again = start_proxy(upstreams, **{**opts, "home": tmp_path / "home2"})
        assert again.versions.ready.wait(30)
        assert again.state.canary.active is not None and again.state.canary.active.candidate == "cand"
        assert [r.version for r in again.state.pool.replicas] == ["cand", "base"]
        for i in range(12):  # every session keeps its arm and its version
            _call(again, f"s{i}")
        _call(again, "old")
        again.flush()
        assert _arms(factory, vid) == before
        for i in range(12):
            assert _served(again, factory, f"s{i}") == {"cand" if before[f"s{i}"] == "candidate" else "base"}
        assert _served(again, factory, "old") == {"base"}
        # The resumed monitor decides: both arms rewarded alike until it promotes.
        n = 0
        while httpx.get(again.url + "/atdp/v1/versions/cand", headers=ADMIN).json()["status"] == "canary" and n < 200:
            sid = f"r{n}"
            _call(again, sid)
            again.flush()
            assert httpx.post(f"{again.url}/atdp/v1/sessions/{sid}/feedback", json={"reward": 1.0}).status_code in (200, 201)
            n += 1
        detail = httpx.get(again.url + "/atdp/v1/versions/cand", headers=ADMIN).json()
        assert detail["status"] == "serving", detail
        assert (b.weights, b.version) == ("cand", "cand")
        with factory() as s:
            row = s.get(t.Canary, vid)
            assert row.decision == "promoted" and row.decided_at is not None
        card = httpx.get(again.url + "/atdp/v1/versions/cand/card", headers=ADMIN).json()
        canary_sessions = sum(1 for arm in _arms(factory, vid).values() if arm == "candidate")
        assert card["affected"]["canary"] == {"tenants": {"t-restart": canary_sessions}, "sessions": canary_sessions,
                                              "decision": "promoted"}
        gate = next(g for g in card["gates"] if g["gate"] == "canary")
        assert gate["state"] == "passed" and gate["numbers"]["verdict"] == "promote"
    finally:
        sa.stop()
        sb.stop()


def test_named_tenant_goes_to_the_candidate_and_operator_rollback_ends_the_canary(start_proxy, own_db):
    url, factory = own_db
    (a, sa), (b, sb) = _two_fakes()
    try:
        proxy = start_proxy([sa.url, sb.url], database_url=url, canary_tenants="t-acme", tenant="t-acme")
        assert proxy.versions.ready.wait(30)
        r = _post(proxy, {"checkpoint": "/ckpt/c2", "name": "c2", "wait": True})
        assert r.json()["status"] == "canary", r.text
        vid = r.json()["id"]
        for i in range(6):
            _call(proxy, f"s{i}")
        proxy.flush()
        assert set(_arms(factory, vid).values()) == {"candidate"}
        card = httpx.get(proxy.url + "/atdp/v1/versions/c2/card", headers=ADMIN).json()
        assert card["rollback"]["possible"] and card["rollback"]["note"].startswith("ends the canary")
        assert card["affected"]["canary"] == {"tenants": {"t-acme": 6}, "sessions": 6, "decision": None}
        assert all(_served(proxy, factory, f"s{i}") == {"c2"} for i in range(6))
        # While the canary runs: no override, no rollback of the serving version.
        assert _post(proxy, {"checkpoint": "/ckpt/other", "name": "other", "promote": "now"}).status_code == 409
        assert httpx.get(proxy.url + "/atdp/v1/versions/other", headers=ADMIN).status_code == 404  # nothing registered
        assert httpx.post(proxy.url + "/atdp/v1/versions/base/rollback", headers=ADMIN).status_code == 409
        back = httpx.post(proxy.url + "/atdp/v1/versions/c2/rollback", headers=ADMIN, timeout=60)
        assert back.status_code == 200 and back.json()["status"] == "rolled_back", back.text
        assert (a.weights, a.version) == ("fake", "base") and proxy.state.canary.active is None
        _call(proxy, "after")
        proxy.flush()
        assert _served(proxy, factory, "after") == {"base"}
        with factory() as s:
            assert s.get(t.Canary, vid).decision == "rolled_back"
            actions = s.scalars(select(t.AuditEvent.action).where(t.AuditEvent.target == vid)).all()
        assert "version.canary" in actions and "version.canary_rollback" in actions
    finally:
        sa.stop()
        sb.stop()


def test_one_replica_skips_the_canary_and_promotes(start_proxy, own_db, fake_upstream):
    url, _ = own_db
    proxy = start_proxy([fake_upstream.url], database_url=url, canary_fraction=0.5)
    assert proxy.versions.ready.wait(30)
    r = _post(proxy, {"checkpoint": "/ckpt/solo", "name": "solo", "wait": True})
    body = r.json()
    assert body["status"] == "serving", body
    gate = next(g for g in body["gates"] if g["gate"] == "canary")
    assert gate["state"] == "skipped" and "more replicas" in gate["numbers"]["reason"]
