"""Gates on by default, on a fresh install (real PostgreSQL, scripted upstream).

No operator suite and no setting: a posted checkpoint is not served unevaluated. It waits
(`evaluating`, its gates `pending`, the count of cases it needs on the card) while 10% of sessions are
held out of training from the first one; once enough held-out sessions are rewarded, the proxy counts
again, replays them on both versions (scored against the rewarded recorded answers) and promotes the
candidate. `ATDP_GATES=off` is the explicit way back to promoting a candidate with no cases, and the
card says so.
"""

from __future__ import annotations

import time

import httpx
import openai
from sqlalchemy import func, select

from proxy.config import Settings
from proxy.governance.policy import TenantPolicy
from proxy.store import tables as t
from proxy.store.holdout import held_out_sql

ADMIN = {"authorization": "Bearer admin-test-key"}
ADD = [{"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def _detail(proxy, name: str) -> dict:
    r = httpx.get(f"{proxy.url}/atdp/v1/versions/{name}", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _gates(detail: dict) -> dict[str, dict]:
    return {g["gate"]: g for g in detail["gates"]}


def _served_by(proxy) -> str:
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    r = c.chat.completions.with_raw_response.create(model="fake", messages=[{"role": "user", "content": "#say hi"}])
    return r.headers["x-atdp-model-version"]


def test_the_defaults_hold_sessions_out_and_keep_gates_on():
    assert Settings().gates == "on" and Settings().eval_min_cases == 20
    assert TenantPolicy().eval_holdout == 0.1


def test_a_fresh_installs_candidate_waits_for_cases_then_is_evaluated(start_proxy, fake_upstream, own_db):
    # A database of its own (a fresh install), and the fixture's test defaults (gates off, nothing held
    # out) undone: the product's defaults, with the recount every half second instead of every minute.
    proxy = start_proxy([fake_upstream.url], database_url=own_db[0], policy_file=None, gates="on",
                        eval_recheck_s=0.5)
    assert proxy.versions.ready.wait(30)
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": "/ckpt/cand", "name": "cand", "wait": True})
    assert r.status_code == 202, r.text
    detail = r.json()
    assert detail["status"] == "evaluating"
    replay = _gates(detail)["replay_eval"]
    assert replay["state"] == "pending" and replay["numbers"]["cases"] == 0 and replay["numbers"]["needs"] == 20
    assert "waiting for evaluation cases: 0 of 20" in replay["numbers"]["reason"]
    card = httpx.get(f"{proxy.url}/atdp/v1/versions/cand/card", headers=ADMIN, timeout=10).json()
    assert {g["gate"]: g["state"] for g in card["gates"]} == {"replay_eval": "pending", "safety": "pending"}
    assert _served_by(proxy) == "base"  # not served unevaluated

    # Agent traffic with rewards: each session one tool call; about a tenth of them are held out.
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    held_steps, n = 0, 0  # held-out steps the gate can use: eligible, answered
    factory = proxy.state.factory
    while held_steps < 20:
        assert n < 600, f"{n} sessions and only {held_steps} held-out steps: the held-out share is not applied"
        sids = [f"gd-{proxy.tenant}-{n + k}" for k in range(40)]
        for sid in sids:
            c.chat.completions.create(model="fake", tools=ADD, extra_headers={"x-atdp-session-id": sid},
                                      messages=[{"role": "user", "content": '#tool add {"a": 12, "b": 7}'}])
        proxy.flush()
        for sid in sids:
            fb = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/feedback", json={"reward": 1.0}, timeout=10)
            assert fb.status_code == 200, fb.text
        n += len(sids)
        with factory() as s:
            held_steps = s.scalar(select(func.count()).select_from(t.Step).join(t.Session, t.Session.id == t.Step.session_id)
                                  .where(t.Session.tenant_id == proxy.tenant, held_out_sql({}, 0.1),
                                         t.Step.status == "ok", t.Step.eligibility == "eligible"))
    assert 0.02 < held_steps / n < 0.25  # about a tenth, by the sessions' hash

    deadline = time.monotonic() + 60
    while (detail := _detail(proxy, "cand"))["status"] == "evaluating" and time.monotonic() < deadline:
        time.sleep(0.25)
    replay = _gates(detail)["replay_eval"]
    assert detail["status"] == "serving", detail
    # Both versions make the rewarded call with valid arguments on every held-out case: no regression.
    assert replay["state"] == "passed" and replay["numbers"]["held_out_cases"] >= 20, replay
    assert replay["numbers"]["evaluators"] == {"recorded": replay["numbers"]["cases"]}
    assert _gates(detail)["safety"]["state"] == "passed"
    assert _served_by(proxy) == "cand"


def test_gates_off_is_explicit_and_on_the_card(start_proxy, fake_upstream, own_db):
    proxy = start_proxy([fake_upstream.url], database_url=own_db[0], policy_file=None, gates="off")
    assert proxy.versions.ready.wait(30)
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": "/ckpt/off", "name": "off", "wait": True})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "serving"
    card = httpx.get(f"{proxy.url}/atdp/v1/versions/off/card", headers=ADMIN, timeout=10).json()
    replay = next(g for g in card["gates"] if g["gate"] == "replay_eval")
    assert replay["state"] == "skipped" and replay["numbers"]["gates"] == "off"
    assert "ATDP_GATES=off" in replay["numbers"]["reason"]


def test_a_candidate_that_waited_while_a_later_one_took_over_is_not_promoted(start_proxy, fake_upstream, own_db):
    # "old" waits for cases; the operator then serves "new" at once. When the proxy counts again, "old"
    # is out of date: promoting it would replace a newer version with an older one. It is rejected.
    proxy = start_proxy([fake_upstream.url], database_url=own_db[0], policy_file=None, gates="on",
                        eval_recheck_s=0.5)
    assert proxy.versions.ready.wait(30)
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": "/ckpt/old", "name": "old", "wait": True})
    assert r.status_code == 202 and r.json()["status"] == "evaluating", r.text
    r = httpx.post(f"{proxy.url}/atdp/v1/versions", headers=ADMIN, timeout=60,
                   json={"checkpoint": "/ckpt/new", "name": "new", "promote": "now"})
    assert r.status_code == 200 and r.json()["status"] == "serving", r.text

    deadline = time.monotonic() + 30
    while (detail := _detail(proxy, "old"))["status"] == "evaluating" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert detail["status"] == "rejected", detail
    assert "superseded by new" in detail["error"]
    assert {g["gate"]: g["state"] for g in detail["gates"]} == {"replay_eval": "skipped", "safety": "skipped"}
    assert _served_by(proxy) == "new"
