"""Diagnosis (issue 14 item 5) on stores seeded through the real proxy, the scripted upstream and the
feedback API: each scenario gets its own database, and the diagnosis must name the layer to fix."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import orjson
import pytest
from sqlalchemy import text

from proxy.evolve.diagnose import diagnose
from proxy.evolve.rules import Rules
from proxy.store import db
from tests.diagnosis_seed import seed_harness, seed_memory, seed_policy, tenant_key

ADMIN = {"Authorization": "Bearer admin-test-key"}


@pytest.fixture
def scenario(new_database, start_proxy, fake_upstream):
    """A fresh store, a proxy in front of the scripted upstream, and a second tenant's key."""
    url = new_database("atdp_diag")
    db.upgrade(url)
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    proxy = start_proxy([fake_upstream.url], database_url=url)
    other = f"t-{uuid.uuid4().hex[:8]}"
    yield url, factory, proxy, other, tenant_key(factory, other)
    engine.dispose()


def _diagnosis(factory) -> dict:
    with factory() as s:
        return diagnose(s, Rules()).to_dict()


def _layers(d: dict) -> set[str]:
    return {f["layer"] for f in d["findings"]}


def _rows(factory, sql: str) -> list:
    with factory() as s:
        return s.execute(text(sql)).all()


def test_failures_on_one_tool_recommend_the_harness(scenario, tmp_path):
    url, factory, proxy, other, key = scenario
    sids = seed_harness(proxy, other_key=key)
    proxy.flush()
    d = _diagnosis(factory)
    assert d["recommendation"] == "harness" and "policy" not in _layers(d) and "memory" not in _layers(d)
    assert d["sessions"] == 6 and d["stats"]["tool_failures"] == 6
    (cluster,) = [f for f in d["findings"] if f["kind"] == "tool_failure_cluster"]
    assert cluster["layer"] == "harness" and cluster["title"] == "deploy: permission denied: <path>"
    assert cluster["evidence"]["failures"] == 6 and cluster["evidence"]["tool_failure_rate"] == 1.0
    assert sorted(cluster["tenants"]) == sorted([proxy.tenant, other]) and set(cluster["examples"]) <= set(sids)
    # The quoted SQL reproduces the rows the finding counted.
    assert len(_rows(factory, cluster["sql"])) == 6
    (schema,) = [f for f in d["findings"] if f["kind"] == "schema_violation"]
    assert schema["layer"] == "harness" and schema["evidence"]["argument"] == "$.env"
    assert schema["evidence"]["problem"] == "required" and schema["evidence"]["violations"] == 6
    assert len(_rows(factory, schema["sql"])) == 6

    # The command line, as an operator runs it: JSON and the readable table.
    env = {**os.environ, "ATDP_DATABASE_URL": url, "ATDP_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "diagnose", "--json"], env=env, check=True,
                         capture_output=True, timeout=120).stdout
    cli = orjson.loads(out)
    assert cli["recommendation"] == "harness" and [f["title"] for f in cli["findings"]] == [f["title"] for f in d["findings"]]
    table = subprocess.run([sys.executable, "-m", "proxy.cli", "diagnose", "--tenant", other], env=env, check=True,
                           capture_output=True, text=True, timeout=120).stdout
    assert "recommendation harness" in table and "deploy: permission denied: <path>" in table and other in table
    bad = tmp_path / "rules.toml"
    bad.write_text("min_failurez = 3\n")
    r = subprocess.run([sys.executable, "-m", "proxy.cli", "diagnose", "--rules", str(bad)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown diagnosis rule 'min_failurez'" in r.stderr


def test_corrections_that_supply_facts_recommend_memory(scenario):
    _, factory, proxy, _, _ = scenario
    sids = seed_memory(proxy)
    d = _diagnosis(factory)
    assert d["recommendation"] == "memory" and _layers(d) == {"memory"}
    (f,) = d["findings"]
    assert f["kind"] == "corrections" and f["tenants"] == [proxy.tenant]
    assert f["evidence"]["corrections"] == 6 and f["evidence"]["supply_facts"] == 6
    assert f["evidence"]["correction_rate"] == 1.0 and set(f["examples"]) <= set(sids)
    assert len(_rows(factory, f["sql"])) == 6


def test_corrections_that_ask_for_behaviour_are_policy_not_memory(scenario):
    _, factory, proxy, _, _ = scenario
    from tests.diagnosis_seed import chat_session, feedback

    for k in range(4):
        sid = chat_session(proxy, f"q {k}", task="helpdesk")
        feedback(proxy, sid, reward=-0.5, correction="Don't be so verbose, keep it shorter")
    d = _diagnosis(factory)
    (f,) = d["findings"]
    assert f["kind"] == "corrections" and f["layer"] == "policy" and f["evidence"]["supply_facts"] == 0


def test_failures_spread_across_tenants_tasks_and_tools_recommend_policy(scenario):
    _, factory, proxy, other, key = scenario
    seed_policy(proxy, other_key=key)
    proxy.flush()
    d = _diagnosis(factory)
    assert d["recommendation"] == "policy" and "harness" not in _layers(d)
    top = d["findings"][0]
    assert top["kind"] == "spread_failures" and top["layer"] == "policy"
    assert top["evidence"]["by_tool"] == {"read_file": 4, "run_tests": 4, "search": 4}
    assert sorted(top["tenants"]) == sorted([proxy.tenant, other])
    assert sum(r.failures for r in _rows(factory, top["sql"])) == 12
    clusters = {f["title"]: f["layer"] for f in d["findings"] if f["kind"] == "tool_failure_cluster"}
    assert clusters == {"read_file: no such file: <path>": "policy", "run_tests: <n> tests failed in <path>": "policy",
                        "search: timeout after <n> s": "policy"}


def test_route_needs_a_key_and_scopes_a_tenant_key_to_its_tenant(scenario, start_proxy, fake_upstream):
    db_url, factory, proxy, other, key = scenario
    seed_policy(proxy, other_key=key, n=6)
    proxy.flush()
    # A second proxy on the same store, with keys required (the seeding one runs in open mode).
    closed = start_proxy([fake_upstream.url], database_url=db_url, open_mode=False)
    url = f"{closed.url}/atdp/v1/diagnosis"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    everything = httpx.get(url, headers=ADMIN).json()
    assert everything["tenant"] is None and everything["sessions"] == 6
    assert everything["recommendation"] == "policy"
    own = httpx.get(url, headers={"Authorization": f"Bearer {key}"}).json()
    assert own["tenant"] == other and own["sessions"] == 3
    assert all(f["tenants"] == [other] for f in own["findings"])
    assert {t["tenant"] for t in own["stats"]["cost"]} == {other}
    # One tenant alone is not a spread over tenants: the same failures are not a policy finding there.
    assert not any(f["kind"] == "spread_failures" for f in own["findings"])
    narrowed = httpx.get(url, params={"tenant": other}, headers=ADMIN).json()
    assert narrowed["tenant"] == other and narrowed["sessions"] == 3
    forbidden = httpx.get(url, params={"tenant": proxy.tenant}, headers={"Authorization": f"Bearer {key}"})
    assert forbidden.status_code == 403
    # Rules can be overridden per call; bad ones are refused.
    loose = httpx.get(url, params={"min_failures": 100}, headers=ADMIN).json()
    assert not any(f["kind"] in ("tool_failure_cluster", "spread_failures") for f in loose["findings"])
    assert loose["rules"]["min_failures"] == 100
    for bad in ({"min_failures": "many"}, {"no_such_rule": 1}, {"concentration_share": 2}, {"window_days": 0}):
        assert httpx.get(url, params=bad, headers=ADMIN).status_code == 400, bad


def test_a_reward_decline_and_growing_prompts_are_found_per_tenant_and_task(scenario):
    _, factory, proxy, _, _ = scenario
    from tests.diagnosis_seed import chat_session, feedback

    # The earlier half of the window is rewarded, the later half is not; and its prompts grew 20-fold.
    for k in range(8):
        later = k >= 4
        sid = chat_session(proxy, "ok", task="triage", system=("context " * (400 if later else 20)))
        feedback(proxy, sid, reward=-1.0 if later else 1.0)
    d = _diagnosis(factory)
    (trend,) = [f for f in d["findings"] if f["kind"] == "reward_trend"]
    assert trend["layer"] == "policy" and trend["evidence"]["earlier_half"] == 1.0
    assert trend["evidence"]["later_half"] == -1.0 and trend["score"] == 1.0
    assert [r.combined_reward for r in _rows(factory, trend["sql"])] == [1.0] * 4 + [-1.0] * 4
    (cost,) = [f for f in d["findings"] if f["kind"] == "cost"]
    assert cost["layer"] == "harness" and cost["evidence"]["growth"] > 5 and cost["evidence"]["prompt_share"] > 0.9
    assert d["stats"]["rewards"][0]["by_version"]["base"]["sessions"] == 8


def test_the_route_serves_a_snapshot_and_says_when_the_store_moved(scenario, start_proxy, fake_upstream):
    """A page asks often; the diagnosis of a large window takes about a second: the route serves the
    last one while nothing changed, and while the store moves serves it marked `newer_data` (a newer
    one computed in the background) for at most `diagnosis_max_age_s`."""
    import time

    db_url, factory, proxy, other, key = scenario
    seed_policy(proxy, other_key=key, n=6)
    proxy.flush()
    closed = start_proxy([fake_upstream.url], database_url=db_url, open_mode=False, diagnosis_max_age_s=3600)
    url = f"{closed.url}/atdp/v1/diagnosis"
    # The all-tenants diagnosis is computed at start-up: the first page finds it there.
    deadline = time.monotonic() + 60
    while not closed.state.diagnosis.snapshots or closed.state.diagnosis.running:
        assert time.monotonic() < deadline, "no diagnosis was computed at start-up"
        time.sleep(0.1)
    (warmed,) = closed.state.diagnosis.snapshots.values()
    first = httpx.get(url, headers=ADMIN).json()
    assert first["newer_data"] is False and first["sessions"] == 6
    assert first["generated_at"] == warmed.result["generated_at"]
    again = httpx.get(url, headers=ADMIN).json()
    assert again == first  # the store did not move: the same snapshot, exact

    seed_policy(proxy, other_key=key, n=2)
    proxy.flush()
    # The first answer after the change is the older snapshot, marked: what it counts is the old store.
    stale = httpx.get(url, headers=ADMIN).json()
    assert stale["newer_data"] is True and stale["sessions"] == first["sessions"]
    deadline = time.monotonic() + 60
    while (now := httpx.get(url, headers=ADMIN).json())["sessions"] == first["sessions"]:
        assert time.monotonic() < deadline, "the background diagnosis never replaced the snapshot"
        time.sleep(0.2)
    assert now["newer_data"] is False and now["sessions"] > first["sessions"]
    fresh = httpx.get(url, params={"fresh": "1"}, headers=ADMIN).json()
    assert fresh["sessions"] == now["sessions"] and fresh["generated_at"] > now["generated_at"]
    # A tenant key gets its own snapshot, never the all-tenants one.
    own = httpx.get(url, headers={"Authorization": f"Bearer {key}"}).json()
    assert own["tenant"] == other and all(f["tenants"] == [other] for f in own["findings"])


def test_with_no_allowed_age_every_change_is_waited_for(scenario, start_proxy, fake_upstream):
    db_url, factory, proxy, other, key = scenario
    seed_policy(proxy, other_key=key, n=4)
    proxy.flush()
    closed = start_proxy([fake_upstream.url], database_url=db_url, open_mode=False, diagnosis_max_age_s=0)
    url = f"{closed.url}/atdp/v1/diagnosis"
    before = httpx.get(url, headers=ADMIN).json()
    seed_policy(proxy, other_key=key, n=2)
    proxy.flush()
    after = httpx.get(url, headers=ADMIN).json()
    assert after["newer_data"] is False and after["sessions"] > before["sessions"]
