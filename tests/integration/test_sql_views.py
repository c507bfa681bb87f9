"""The audit views (migration 0002) and every query in docs/sql/, on data made through the real proxy."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, inspect, or_, select, text

from proxy.governance.policies import Policies
from proxy.store import db
from proxy.store import tables as t
from proxy.store.db import transaction
from proxy.tools.replay import replay_session
from tests.proxy_fixtures import shared_redactor
from tests.session_builders import agent_session, anthropic_session

SQL_DIR = Path(__file__).resolve().parents[2] / "docs" / "sql"
VIEWS = {"atdp_steps_readable", "atdp_feedback_readable", "atdp_session_outcomes", "atdp_tool_failures",
         "atdp_version_lineage", "atdp_redaction_counts", "atdp_replay_pairs"}


def query(factory, name: str, **params) -> list[dict]:
    """Load a docs/sql file as written and run it with bound parameters."""
    sql = (SQL_DIR / name).read_text()
    assert sql.startswith("-- " + name), f"{name} must start with a header comment naming it"
    with factory() as s:
        return [dict(r._mapping) for r in s.execute(text(sql), params)]


@pytest.fixture(scope="module")
def world(request, db_url, factory, tmp_path_factory):
    """Sessions made by an agent through the proxy, plus what the trainer and a replay add."""
    from proxy.app import create_app
    from proxy.config import Settings
    from tests.fake_vllm import FakeVLLM, ServerThread
    from tests.proxy_fixtures import RunningProxy, wait_for_db

    fake = FakeVLLM()
    upstream = ServerThread(fake).start()
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    settings = Settings(home=tmp_path_factory.mktemp("home"), database_url=db_url, upstream_urls=[upstream.url],
                        open_mode=True, default_tenant=tenant, secret=b"test-secret", admin_key="admin-test-key")
    app = create_app(settings, redactor=shared_redactor(settings.secret))
    server = ServerThread(app).start()
    wait_for_db(app.state.atdp)
    proxy = RunningProxy.of(app, server, tenant)
    try:
        version = f"ver-{tenant}"
        a = agent_session(proxy, session_id=f"a-{tenant}", tool_results=("the notes say hi", "2 passed"))
        b = agent_session(proxy, session_id=f"b-{tenant}", tool_results=(), final="#say call me at jane@example.com")
        c = agent_session(proxy, session_id=f"c-{tenant}", tool_results=())
        proxy.flush()
        fb = f"{proxy.url}/atdp/v1/sessions"
        for sid, body in ((a, {"reward": 0.8}), (a, {"correction": "read notes.md, not f0.txt"}),
                          (b, {"reward": -0.2, "comment": "rude; cc bob@example.org"}), (b, {"reward": 0.3}),
                          (c, {"reward": 0.5})):
            assert httpx.post(f"{fb}/{sid}/feedback", json=body).status_code == 200
        steps_a = proxy.steps(factory, a)
        steps_b = proxy.steps(factory, b)
        # A tool result the agent marked as failed (Anthropic `is_error`), through the Messages door.
        d = anthropic_session(proxy, session_id=f"d-{tenant}", result="1 failed", is_error=True)
        proxy.flush()
        with transaction(factory) as s:
            # What a trainer writes: its candidate version and the steps that trained it.
            s.add(t.ModelVersion(id=version, name=f"policy-{tenant}", checkpoint="/ckpt/v1", status="candidate"))
            s.flush()
            for st, reward in ((steps_a[0], 0.8), (steps_a[2], 0.8), (steps_b[0], 0.3)):
                s.add(t.VersionLineage(version_id=version, step_id=st.id, session_id=st.session_id, reward=reward))
        fake.weights = "w1"
        replay = replay_session(factory, a, tenant=tenant, upstream=upstream.url, redactor=shared_redactor(b"test-secret"),
                                secret=b"test-secret", policies=Policies(), model_version="v-next")
        yield {"proxy": proxy, "tenant": tenant, "a": a, "b": b, "c": c, "d": d, "version": version,
               "steps_a": steps_a, "steps_b": steps_b, "replay": replay}
    finally:
        server.stop()
        upstream.stop()


def test_migration_creates_and_drops_the_views(new_database):
    url = new_database()
    db.upgrade(url)
    engine = create_engine(db.sqlalchemy_url(url))
    try:
        assert set(inspect(engine).get_view_names()) >= VIEWS
        db.downgrade(url, "0001")
        assert not VIEWS & set(inspect(engine).get_view_names())
        db.upgrade(url)
        assert set(inspect(engine).get_view_names()) >= VIEWS
    finally:
        engine.dispose()


def test_every_sql_file_is_tested():
    tested = {"session_steps.sql", "sessions_by_reward.sql", "tool_failure_rates.sql", "correction_rate_by_day.sql",
              "step_version.sql", "sessions_trained_version.sql", "redaction_counts.sql", "replay_vs_original.sql"}
    assert {p.name for p in SQL_DIR.glob("*.sql")} == tested


def test_session_steps_in_order_with_tool_calls_and_results(world, factory):
    rows = query(factory, "session_steps.sql", tenant=world["tenant"], session_id=world["a"])
    assert [(r["seq"], r["tool"], r["result_seq"], r["tool_result"]) for r in rows] == [
        (1, "read_file", 2, "the notes say hi"), (2, "run_tests", 3, "2 passed"), (3, None, None, None)]
    assert [r["step_id"] for r in rows] == [s.id for s in world["steps_a"]]
    assert rows[0]["tool_arguments"] == '{"path": "f0.txt"}' and rows[0]["tool_error"] is False
    assert rows[2]["assistant_text"] == "[w0] done" and rows[0]["assistant_text"] is None
    assert all(r["status"] == "ok" and r["model_version"] == world["steps_a"][0].model_version for r in rows)


def test_sessions_by_reward(world, factory):
    rows = query(factory, "sessions_by_reward.sql", tenant=world["tenant"], min_reward=None)
    # b's two rewards combine to the last one (the default policy); d has none.
    assert [(r["session_id"], r["combined_reward"], r["session_rewards"]) for r in rows] == [
        (world["a"], 0.8, 1), (world["c"], 0.5, 1), (world["b"], 0.3, 2)]
    assert rows[0]["steps"] == 3 and rows[0]["corrections"] == 1 and rows[2]["corrections"] == 0
    assert [r["session_id"] for r in query(factory, "sessions_by_reward.sql", tenant=world["tenant"], min_reward=0.5)] == [
        world["a"], world["c"]]
    everyone = query(factory, "sessions_by_reward.sql", tenant=None, min_reward=None)
    assert {world["a"], world["b"], world["c"]} <= {r["session_id"] for r in everyone}


def test_tool_failure_rates(world, factory):
    rows = query(factory, "tool_failure_rates.sql", tenant=world["tenant"])
    assert [(r["tool"], r["calls"], r["results"], r["errors"], r["failure_rate"]) for r in rows] == [
        ("run_tests", 2, 2, 1, 0.5), ("read_file", 1, 1, 0, 0.0)]


def test_correction_rate_by_day(world, factory):
    rows = query(factory, "correction_rate_by_day.sql", tenant=world["tenant"], since=None)
    with factory() as s:
        started = s.execute(select(t.Session.id, t.Session.external_id, t.Session.started_at).where(
            t.Session.tenant_id == world["tenant"], t.Session.replay_of.is_(None))).all()
    # a, b, c and d (the replay of a is not a user session); only a was corrected. Their days are read
    # from their start times, not from the clock: a run may cross midnight after the module's world.
    assert len(started) == 4
    day_of = {key: when.astimezone(UTC).date() for sid, ext, when in started for key in (sid, ext)}
    days = Counter(when.astimezone(UTC).date() for _, _, when in started)
    corrected = day_of[world["a"]]
    assert [(r["day"], r["sessions"], r["corrected_sessions"], r["corrections"]) for r in rows] == [
        (day, n, int(day == corrected), int(day == corrected)) for day, n in sorted(days.items())]
    assert [r["correction_rate"] for r in rows] == pytest.approx(
        [int(day == corrected) / n for day, n in sorted(days.items())])
    assert query(factory, "correction_rate_by_day.sql", tenant=world["tenant"], since=datetime(2999, 1, 1, tzinfo=UTC)) == []


def test_step_version(world, factory):
    step = world["steps_a"][2]
    (row,) = query(factory, "step_version.sql", step_id=step.id)
    # Tokens are stamped with the serving version's name when the call entered the replica's gate.
    assert row["model_version"] == row["token_version"] == step.model_version
    assert row["tokens"] == len(step.output_token_ids) and row["session_id"] == world["a"]
    with factory() as s:
        registered = s.scalar(select(t.ModelVersion).where(
            or_(t.ModelVersion.name == step.model_version, t.ModelVersion.id == step.model_version)))
    assert row["version_id"] == (registered.id if registered else None)
    if registered:
        assert row["version_name"] == registered.name and row["checkpoint"] == registered.checkpoint
    # A replayed step names the version the replay targeted, one run of all its tokens.
    replayed = world["replay"].steps[2]["replay_step_id"]
    (row,) = query(factory, "step_version.sql", step_id=replayed)
    assert row["token_version"] == "v-next" and row["version_id"] is None and row["tokens"] > 0


def test_sessions_that_trained_a_version(world, factory):
    for key in (world["version"], f"policy-{world['tenant']}"):  # by id or by name
        rows = query(factory, "sessions_trained_version.sql", version=key)
        assert [(r["session_id"], r["steps"], r["first_seq"], r["last_seq"]) for r in rows] == [
            (world["a"], 2, 1, 3), (world["b"], 1, 1, 1)]
        assert rows[0]["mean_reward"] == pytest.approx(0.8)
    assert query(factory, "sessions_trained_version.sql", version="no-such-version") == []


def test_redaction_counts(world, factory):
    rows = {r["entity"]: r for r in query(factory, "redaction_counts.sql", tenant=world["tenant"])}
    # b's message and the model's echo of it each hold one address; the feedback comment another.
    email = rows["EMAIL_ADDRESS"]
    assert email["redacted_values"] >= 3 and "feedback" in email["found_in"] and "message" in email["found_in"]
    with factory() as s:
        stored = s.execute(text("SELECT body::text FROM contents WHERE tenant_id = :t"), {"t": world["tenant"]}).scalars().all()
    assert not any("jane@example.com" in b for b in stored)


def test_replay_vs_original(world, factory):
    replay = world["replay"]
    for sid in (replay.session_id, world["a"]):
        rows = query(factory, "replay_vs_original.sql", tenant=world["tenant"], session_id=sid)
        assert [r["seq"] for r in rows] == [1, 2, 3]
        assert [r["same_tool_calls"] for r in rows] == [True, True, True]
        assert [r["original_tool_calls"] for r in rows] == [["read_file"], ["run_tests"], []]
        assert [(r["original_text"], r["replay_text"], r["same_text"]) for r in rows][2] == ("[w0] done", "[w1] done", False)
        assert [r["replay_version"] for r in rows] == ["v-next"] * 3
        assert [r["original_step_id"] for r in rows] == [s.id for s in world["steps_a"]]
        assert all(r["replay_completion_tokens"] == r["original_completion_tokens"] for r in rows[:2])
