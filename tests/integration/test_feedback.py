"""Feedback, close, and the session records API, on the real proxy + PostgreSQL (scripted upstream)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx
import jsonschema
import pytest
from sqlalchemy import select, update

import atdp_schema
from proxy.auth import create_key
from proxy.store import tables as t
from proxy.store.db import transaction
from tests.session_builders import agent_session

ADMIN = {"Authorization": "Bearer admin-test-key"}


def fb_url(proxy, sid: str) -> str:
    return f"{proxy.url}/atdp/v1/sessions/{sid}/feedback"


def session_json(proxy, sid: str, **kw) -> dict:
    r = httpx.get(f"{proxy.url}/atdp/v1/sessions/{sid}", **kw)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def captured(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    sid = agent_session(proxy, tool_results=("the notes say hi", "2 passed"), task_id="task-1")
    steps = proxy.steps(factory, sid)
    assert len(steps) == 3
    return proxy, sid, steps


def test_session_document_is_valid_atdp_with_steps_tools_and_feedback(captured, factory):
    proxy, sid, steps = captured
    r = httpx.post(fb_url(proxy, sid), json={"reward": 0.5, "comment": "good"})
    assert r.status_code == 200, r.text
    r = httpx.post(fb_url(proxy, sid), json={"reward": -0.25, "step_id": steps[0].id, "source": "evaluator"})
    assert r.status_code == 200, r.text
    doc = session_json(proxy, sid)
    jsonschema.validate({"atdp_version": "1.0", "sessions": [doc], "versions": []}, atdp_schema.json_schema())
    assert doc["id"] == sid and doc["tenant"] == proxy.tenant and doc["task_id"] == "task-1"
    assert [s["seq"] for s in doc["steps"]] == [1, 2, 3]
    assert [s["id"] for s in doc["steps"]] == [s.id for s in steps]
    s1, s2, s3 = doc["steps"]
    assert [c["name"] for c in s1["action"]["tool_calls"]] == ["read_file"]
    assert [c["name"] for c in s2["action"]["tool_calls"]] == ["run_tests"]
    # The tool result sent with step 2 is linked to the call step 1 made; same for 3 -> 2.
    (res,) = s2["observation"]["tool_results"]
    assert res["call_step_id"] == s1["id"] and res["tool_call_id"] == s1["action"]["tool_calls"][0]["id"]
    assert res["content"]["content"] == "the notes say hi"
    assert s3["observation"]["tool_results"][0]["call_step_id"] == s2["id"]
    assert s3["action"]["text"] == "[w0] done" and s3["parent_step_id"] == s2["id"]
    # Full prompt ids are rebuilt from the prefix chain (the fake renders one id per byte).
    assert bytes(s3["tokens"]["prompt_token_ids"]).startswith(b"<|system|>You are a coding agent.<|end|>")
    assert s3["model_version"]  # the serving version's name, stamped on every output token
    assert s3["tokens"]["output_versions"] == [{"version": s3["model_version"], "count": len(s3["tokens"]["output_token_ids"])}]
    assert s1["governance"]["eligibility"] == "eligible"
    assert doc["reward"] == 0.5
    scopes = sorted((f["scope"], f["reward"], f["source"]) for f in doc["feedback"])
    assert scopes == [("session", 0.5, "human"), ("step", -0.25, "evaluator")]


def test_idempotency_same_body_same_result_different_body_conflict(captured, factory):
    proxy, sid, steps = captured
    body = {"reward": 1.0, "step_id": steps[1].id, "idempotency_key": "k-1", "comment": "ok"}
    a = httpx.post(fb_url(proxy, sid), json=body)
    b = httpx.post(fb_url(proxy, sid), json=dict(body))
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json() and a.json()["step_id"] == steps[1].id and a.json()["scope"] == "step"
    c = httpx.post(fb_url(proxy, sid), json={**body, "reward": 0.0})
    assert c.status_code == 409 and "idempotency key" in c.json()["error"]["message"]
    with factory() as s:
        rows = s.scalars(select(t.Feedback).where(t.Feedback.idempotency_key == "k-1")).all()
        audits = s.scalars(select(t.AuditEvent).where(t.AuditEvent.tenant_id == proxy.tenant,
                                                      t.AuditEvent.action == "feedback.create")).all()
    assert len(rows) == 1
    assert len(audits) == 2 and {a.target for a in audits} == {rows[0].id}
    assert [a.details["idempotent_replay"] for a in sorted(audits, key=lambda a: a.id)] == [False, True]


def test_validation_errors_are_clear(captured, factory):
    proxy, sid, steps = captured
    cases = [
        ({"reward": 2.0}, 422, "outside this tenant's range"),
        ({"reward": True}, 422, "finite number"),
        ({"reward": "1"}, 422, "finite number"),
        ({}, 422, "at least one of"),
        ({"reward": 0.1, "source": "oracle"}, 422, "'source' must be one of"),
        ({"reward": 0.1, "rewrd": 1}, 422, "unknown feedback fields"),
        ({"reward": 0.1, "step_id": "nope"}, 404, "is not a step of session"),
    ]
    for body, status, text in cases:
        r = httpx.post(fb_url(proxy, sid), json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert text in err["message"] and err["type"]
    r = httpx.post(fb_url(proxy, "no-such-session"), json={"reward": 0.1})
    assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
    r = httpx.post(fb_url(proxy, sid), content=b'{"reward": 1e999}', headers={"content-type": "application/json"})
    assert r.status_code == 400  # not finite: refused as malformed JSON
    # A step of another session of the same tenant is not a step of this one.
    other = agent_session(proxy, tool_results=())
    (other_step,) = proxy.steps(factory, other)
    r = httpx.post(fb_url(proxy, sid), json={"reward": 0.1, "step_id": other_step.id})
    assert r.status_code == 404


def test_reward_range_and_combination_follow_tenant_policy(captured, factory):
    proxy, sid, steps = captured
    with transaction(factory) as s:
        proxy.state.policies.set_policy(s, proxy.tenant, {"reward_min": 0.0, "reward_max": 10.0, "reward_combine": "mean"}, actor="test")
    assert httpx.post(fb_url(proxy, sid), json={"reward": -0.5}).status_code == 422
    for r in (2.0, 4.0, 9.0):
        assert httpx.post(fb_url(proxy, sid), json={"reward": r}).status_code == 200
    doc = session_json(proxy, sid)
    assert doc["reward"] == pytest.approx(5.0)
    assert [f["reward"] for f in doc["feedback"]] == [2.0, 4.0, 9.0]  # every one is kept


def test_last_reward_wins_by_default(captured):
    proxy, sid, _ = captured
    for r in (0.9, -0.3):
        assert httpx.post(fb_url(proxy, sid), json={"reward": r}).status_code == 200
    assert session_json(proxy, sid)["reward"] == -0.3


def test_comments_and_corrections_are_redacted_and_default_source(captured, factory):
    proxy, sid, _ = captured
    r = httpx.post(fb_url(proxy, sid), json={
        "comment": "wrong file, mail jane.doe@example.com", "correction": "use key sk-proj-abcdefghijklmnopqrstuvwxyz0123456789AB"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["source"] == "user_correction" and got["reward"] is None
    assert "jane.doe@example.com" not in got["comment"] and "EMAIL" in got["comment"]
    assert "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789AB" not in got["correction"]
    with factory() as s:
        row = s.get(t.Feedback, got["id"])
    assert row.comment == got["comment"] and row.redaction.get("EMAIL_ADDRESS") == 1
    assert "jane.doe" not in str(row.redaction) and len(row.redaction) == 2


def test_late_feedback_is_stored_and_flagged(captured, factory):
    proxy, sid, steps = captured
    early = httpx.post(fb_url(proxy, sid), json={"reward": 0.2, "step_id": steps[2].id}).json()
    assert early["late"] is False
    with transaction(factory) as s:  # what the trainer does once it has trained on the step
        s.execute(update(t.Step).where(t.Step.id == steps[2].id).values(trained_version_id="v-test"))
    late = httpx.post(fb_url(proxy, sid), json={"reward": 0.7, "step_id": steps[2].id}).json()
    assert late["late"] is True and late["reward"] == 0.7
    untouched = httpx.post(fb_url(proxy, sid), json={"reward": 0.1, "step_id": steps[0].id}).json()
    assert untouched["late"] is False
    assert httpx.post(fb_url(proxy, sid), json={"reward": 0.3}).json()["late"] is True  # session: a step trained
    flags = sorted((f["reward"], f["late"]) for f in session_json(proxy, sid)["feedback"])
    assert flags == [(0.1, False), (0.2, False), (0.3, True), (0.7, True)]


def test_close_then_feedback_still_accepted(captured, factory):
    proxy, sid, _ = captured
    r = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/close")
    assert r.status_code == 200 and r.json()["status"] == "closed" and r.json()["ended_at"]
    first_end = r.json()["ended_at"]
    assert httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/close").json()["ended_at"] == first_end
    assert httpx.post(fb_url(proxy, sid), json={"reward": 1.0}).status_code == 200
    doc = session_json(proxy, sid)
    assert doc["status"] == "closed" and doc["ended_at"] and doc["reward"] == 1.0
    with factory() as s:
        actions = s.scalars(select(t.AuditEvent.action).where(t.AuditEvent.tenant_id == proxy.tenant)).all()
    assert actions.count("session.close") == 1 and "feedback.create" in actions


def test_tenants_are_isolated_and_admin_sees_all(captured, factory):
    proxy, sid, _ = captured
    other_tenant = f"t-{uuid.uuid4().hex[:8]}"
    with transaction(factory) as s:
        key_id, key = create_key(s, other_tenant)
    other = {"Authorization": f"Bearer {key}"}
    # Another tenant's key cannot see, score, or close this session.
    assert httpx.get(f"{proxy.url}/atdp/v1/sessions/{sid}", headers=other).status_code == 404
    assert httpx.post(fb_url(proxy, sid), json={"reward": 1.0}, headers=other).status_code == 404
    assert httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/close", headers=other).status_code == 404
    assert httpx.get(f"{proxy.url}/atdp/v1/sessions", headers=other).json()["data"] == []
    # The admin key sees it (and may narrow to a tenant), and its feedback is audited as the admin.
    assert session_json(proxy, sid, headers=ADMIN)["tenant"] == proxy.tenant
    listed = httpx.get(f"{proxy.url}/atdp/v1/sessions", params={"tenant": proxy.tenant, "limit": 500}, headers=ADMIN).json()
    assert sid in [x["id"] for x in listed["data"]]
    assert httpx.get(f"{proxy.url}/atdp/v1/sessions", params={"tenant": other_tenant}, headers=ADMIN).json()["data"] == []
    got = httpx.post(fb_url(proxy, sid), json={"reward": 0.4}, headers=ADMIN).json()
    assert got["posted_by"] == "admin"
    with factory() as s:
        audit = s.scalar(select(t.AuditEvent).where(t.AuditEvent.target == got["id"]))
    assert audit.actor == "admin" and audit.tenant_id == proxy.tenant


def test_list_filters_and_cursor_pagination(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    ids = [agent_session(proxy, tool_results=(), final=f"#say n{i}", task_id="A" if i % 2 else "B") for i in range(5)]
    proxy.flush()
    for sid, reward in zip(ids, (0.9, -0.5, 0.1, None, 0.6), strict=True):
        if reward is not None:
            assert httpx.post(fb_url(proxy, sid), json={"reward": reward}).status_code == 200
    httpx.post(f"{proxy.url}/atdp/v1/sessions/{ids[2]}/close")
    base = f"{proxy.url}/atdp/v1/sessions"

    def listing(**params):
        r = httpx.get(base, params=params)
        assert r.status_code == 200, r.text
        return r.json()

    everything = listing()
    assert [x["id"] for x in everything["data"]] == ids[::-1] and everything["next_cursor"] is None
    assert everything["data"][0]["steps"] == 1 and everything["data"][0]["reward"] == 0.6

    seen, cursor = [], None
    while True:
        page = listing(limit=2, **({"cursor": cursor} if cursor else {}))
        assert len(page["data"]) <= 2
        seen += [x["id"] for x in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]

    assert {x["id"] for x in listing(task_id="A")["data"]} == {ids[1], ids[3]}
    assert [x["id"] for x in listing(status="closed")["data"]] == [ids[2]]
    assert {x["id"] for x in listing(min_reward=0.5)["data"]} == {ids[0], ids[4]}
    assert {x["id"] for x in listing(max_reward=0.0)["data"]} == {ids[1]}
    assert [x["id"] for x in listing(min_reward=0.0, max_reward=0.7, limit=1)["data"]] == [ids[4]]
    assert len(listing(eligibility="eligible")["data"]) == 5
    assert listing(eligibility="quarantined")["data"] == []
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert listing(since=future)["data"] == [] and len(listing(until=future)["data"]) == 5
    for bad in ({"cursor": "!!"}, {"limit": "0"}, {"since": "yesterday"}, {"min_reward": "x"}, {"colour": "red"}):
        r = httpx.get(base, params=bad)
        assert r.status_code == 422 and r.json()["error"]["message"], bad


def test_control_routes_answer_503_while_the_database_is_down(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url], database_url="postgresql://postgres@127.0.0.1:1/absent", wait_db=False)
    for method, path, body in (("POST", "/atdp/v1/sessions/x/feedback", {"reward": 1.0}),
                               ("POST", "/atdp/v1/sessions/x/close", None), ("GET", "/atdp/v1/sessions/x", None),
                               ("GET", "/atdp/v1/sessions", None)):
        r = httpx.request(method, proxy.url + path, json=body)
        assert r.status_code == 503, (path, r.text)
        assert r.json()["error"]["type"] == "service_unavailable" and "database" in r.json()["error"]["message"]
