"""Gates survive a restart: candidates a stopped proxy left `evaluating` are evaluated again when a
proxy starts on the same database, and the engine gets the serving weights back first.

PostgreSQL and the proxy in front of the scripted upstream (tests/fake_vllm.py), whose `#slow S`
answers take S seconds, so the first candidate's gates are still running when the proxy stops, and
the second candidate is queued behind them. The scripted upstream starts every answer with the name
of the weights folder it loaded last, so the suite's regex passes every version.
"""

from __future__ import annotations

import json
import time

import httpx
from sqlalchemy import select

from proxy.store import tables as t

ADMIN = {"authorization": "Bearer admin-test-key"}


def _status(proxy, name: str) -> dict:
    return httpx.get(proxy.url + f"/atdp/v1/versions/{name}", headers=ADMIN, timeout=10).json()


def test_candidates_left_evaluating_are_evaluated_again_after_a_restart(start_proxy, fake_upstream, own_db, tiny_dir,
                                                                         tmp_path):
    from datetime import UTC, datetime, timedelta

    url, factory = own_db
    with factory() as s, s.begin():
        when = datetime.now(UTC) - timedelta(seconds=60)
        s.add(t.ModelVersion(id="base-id", name="base", checkpoint=str(tiny_dir), status="serving", served_at=when,
                             created_at=when, metrics={}))
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "ops.jsonl").write_text(json.dumps({"id": "slow", "messages": [{"role": "user", "content": "#slow 1.5"}],
                                                  "evaluator": "regex", "expected": r"\] slow answer$"}) + "\n")
    first = start_proxy([fake_upstream.url], database_url=url, eval_suites=suites, eval_concurrency=1)
    assert first.versions.ready.wait(30)
    for name in ("c1", "c2"):
        r = httpx.post(first.url + "/atdp/v1/versions", headers=ADMIN, timeout=30,
                       json={"checkpoint": f"/ckpt/{name}", "name": name})
        assert r.status_code == 202, r.text
    deadline = time.monotonic() + 30
    while "c1" not in fake_upstream.reloads:  # c1's weights are loaded: its replay under them runs
        assert time.monotonic() < deadline, fake_upstream.reloads
        time.sleep(0.05)
    # c2 waits for c1's gates, and says so: evaluating, its gates pending.
    queued = _status(first, "c2")
    assert queued["status"] == "evaluating" and {g["state"] for g in queued["gates"]} == {"pending"}
    assert _status(first, "c1")["status"] == "evaluating"
    first.server.stop()
    # A killed proxy runs no cleanup, so the engine keeps c1's weights; stopping the test server
    # cancels the gate's task, whose cleanup may have put base back: set the engine as a kill leaves it.
    fake_upstream.weights, fake_upstream.version = "c1", "c1"
    with factory() as s:
        left = {v.name: v.status for v in s.scalars(select(t.ModelVersion).where(t.ModelVersion.name.in_(["c1", "c2"])))}
    assert left == {"c1": "evaluating", "c2": "evaluating"}

    reloads_before = len(fake_upstream.reloads)
    second = start_proxy([fake_upstream.url], database_url=url, eval_suites=suites, eval_concurrency=1)
    assert second.versions.ready.wait(30)
    # At start-up, before anything is served, the serving weights went back on the engine.
    assert fake_upstream.reloads[reloads_before] == tiny_dir.name
    deadline = time.monotonic() + 60
    while {_status(second, n)["status"] for n in ("c1", "c2")} & {"candidate", "evaluating"}:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    c1, c2 = _status(second, "c1"), _status(second, "c2")
    # Both evaluated again, in the order they were posted: c1 promoted, then c2 over it.
    assert c1["status"] == "retired" and c2["status"] == "serving", (c1, c2)
    for body in (c1, c2):
        assert {g["gate"]: g["state"] for g in body["gates"]} == {"replay_eval": "passed", "safety": "passed"}
        assert all(g["finished_at"] for g in body["gates"])
    assert fake_upstream.weights == "c2"
    with factory() as s:
        resumed = {e.details["name"] for e in s.scalars(select(t.AuditEvent)
                                                         .where(t.AuditEvent.action == "version.gates_resumed"))}
    assert resumed == {"c1", "c2"}
