"""Foundation: migrations, ORM/migration agreement, the ATDP schema, store round trip and dedup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime

import jsonschema
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.exc import DBAPIError

import atdp_schema
from atdp_schema import generate
from proxy.store import db
from proxy.store import tables as t
from proxy.store.content import canonical, content_hash
from proxy.store.ids import new_id, uuid7
from proxy.store.partitions import include_object
from proxy.store.read import session_document
from proxy.store.records import ContentRow, SessionInfo, StepRecord, ToolCallRow, ToolResultRow
from proxy.store.tokens import rle
from proxy.store.write import write_steps

SECRET = b"test-secret"


def test_uuid7_sorts_by_time():
    ids = [uuid7() for _ in range(2000)]
    assert ids == sorted(ids)
    assert all(u.version == 7 for u in ids)


def test_json_schema_is_current():
    assert generate.main(["--check"]) == 0, "atdp_schema/schema.json is stale"


def test_migrations_round_trip(new_database):
    url = new_database()
    db.upgrade(url)
    assert db.current(url) is not None
    db.downgrade(url, "base")
    assert db.current(url) is None
    engine = create_engine(url)
    with engine.connect() as conn:
        tables = conn.execute(text("SELECT count(*) FROM pg_tables WHERE schemaname='public' AND tablename <> 'alembic_version'")).scalar()
    engine.dispose()
    assert tables == 0
    db.upgrade(url)
    assert db.current(url) == db.current(url)


def test_models_and_migrations_agree(db_url):
    engine = create_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "include_object": include_object})
        diff = compare_metadata(ctx, t.Base.metadata)
    engine.dispose()
    assert diff == [], f"ORM models and migrations disagree: {diff}"


def test_audit_log_is_append_only(factory, tenant):
    with db.transaction(factory) as s:
        s.add(t.AuditEvent(actor="test", tenant_id=tenant, action="x"))
    with pytest.raises(DBAPIError, match="append-only"), db.transaction(factory) as s:
        s.execute(text("UPDATE audit_log SET action = 'y' WHERE tenant_id = :t"), {"t": tenant})
    with pytest.raises(DBAPIError, match="append-only"), db.transaction(factory) as s:
        s.execute(text("DELETE FROM audit_log WHERE tenant_id = :t"), {"t": tenant})


# --- building records by hand (the proxy's capture does this for real traffic) -----------------

def _content(kind: str, value) -> ContentRow:
    return ContentRow(hash=content_hash(SECRET, value), kind=kind, body=value, size=len(canonical(value)))


def _record(tenant, session_ext, messages, history_len, output_text, *, parent=None, system=None,
            prompt_ids=(), prefix_len=0, out_ids=(), versions=None, tool_calls=(), tool_results=(), task=None):
    contents = [_content("message", m) for m in messages]
    out = {"text": output_text, "tool_calls": [{"id": c.call_id, "name": c.name, "arguments": c.arguments} for c in tool_calls],
           "output": {"role": "assistant", "content": output_text}}
    contents.append(_content("output", out))
    sys_row = _content("system", system) if system is not None else None
    if sys_row:
        contents.append(sys_row)
    return StepRecord(
        id=new_id(), session=SessionInfo(tenant_id=tenant, external_id=session_ext, client="test", task_id=task),
        api="chat.completions", status="ok", started_at=datetime.now(UTC), parent_step_id=parent,
        model="tiny", model_version="base", system_hash=sys_row.hash if sys_row else None,
        history_len=history_len, message_hashes=[c.hash for c in contents if c.kind == "message"],
        output_hash=contents[len(messages)].hash, contents=contents, tool_calls=list(tool_calls),
        tool_results=list(tool_results), token_source="engine", prompt_prefix_len=prefix_len,
        prompt_token_ids=list(prompt_ids), output_token_ids=list(out_ids),
        output_logprobs=[-0.5] * len(out_ids), output_versions=rle(versions or ["base"] * len(out_ids)),
        finish_reason="stop", ttft_ms=12.5, total_ms=40.0, prompt_tokens=len(prompt_ids) + prefix_len,
        completion_tokens=len(out_ids), eligibility="eligible",
    )


def test_round_trip_session_validates(factory, tenant):
    call = ToolCallRow(call_id="call_1", name="read_file", arguments='{"path": "a.txt"}')
    r1 = _record(tenant, "s-rt", [{"role": "user", "content": "read a.txt"}], 0, "", system="be brief",
                 prompt_ids=[1, 2, 3, 4], out_ids=[5, 6, 7], tool_calls=[call], task="task-1")
    result_msg = {"role": "tool", "tool_call_id": "call_1", "content": "hello"}
    r2 = _record(tenant, "s-rt", [result_msg], 2, "it says hello", parent=r1.id, system="be brief",
                 prompt_ids=[8, 9], prefix_len=7, out_ids=[10, 11], versions=["base", "v1"],
                 tool_results=[ToolResultRow(call_id="call_1", result_hash=content_hash(SECRET, result_msg))])
    with db.transaction(factory) as s:
        assert write_steps(s, [r1, r2], new_id) == 2
        assert write_steps(s, [r1, r2], new_id) == 0  # idempotent (spool replays)
        vid = new_id()
        s.add(t.ModelVersion(id=vid, name=f"v-{tenant}", checkpoint="/ckpt/v1", status="serving"))
        s.flush()
        s.add(t.VersionLineage(version_id=vid, step_id=r1.id, session_id=s.scalar(select(t.Session.id).where(t.Session.external_id == "s-rt", t.Session.tenant_id == tenant))))
        sess = s.scalar(select(t.Session).where(t.Session.tenant_id == tenant, t.Session.external_id == "s-rt"))
        s.add(t.Feedback(id=new_id(), session_id=sess.id, tenant_id=tenant, reward=0.5, source="rule"))
    with factory() as s:
        sess = s.scalar(select(t.Session).where(t.Session.tenant_id == tenant, t.Session.external_id == "s-rt"))
        doc = session_document(s, sess)
    data = json.loads(atdp_schema.Document(sessions=[doc]).model_dump_json())
    jsonschema.validate(data, atdp_schema.json_schema())
    st1, st2 = doc.steps
    assert (st1.seq, st2.seq, st2.parent_step_id) == (1, 2, r1.id)
    assert st2.tokens.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]  # prefix rebuilt from the parent
    assert [(v.version, v.count) for v in st2.tokens.output_versions] == [("base", 1), ("v1", 1)]
    assert st1.action.tool_calls[0].name == "read_file"
    assert st2.observation.tool_results[0].call_step_id == r1.id
    assert st2.observation.tool_results[0].content == result_msg
    assert st1.observation.system.content == "be brief"
    assert st1.trained_in == [vid]
    assert doc.reward == 0.5 and doc.task_id == "task-1"


def test_a_session_row_keeps_its_first_client_and_task_and_moves_forward(factory, tenant):
    """The sessions upsert (one statement over arrays per batch): a session's first client and task
    stay, a later batch fills a task the first lacked, `last_step_at` only moves forward, and the
    JSON fields arrive as documents (a NUL stored as U+FFFD)."""
    from datetime import timedelta

    r1 = _record(tenant, "s-up", [{"role": "user", "content": "one"}], 0, "a")
    r1.session.client_info, r1.session.labels = {"ua": "hermes/1.0"}, {"team": "a\x00b", "n": 2}
    r2 = _record(tenant, "s-up", [{"role": "user", "content": "two"}], 2, "b", parent=r1.id, task="task-9")
    r2.session.client = "other"
    r2.started_at = r1.started_at + timedelta(seconds=5)
    late = _record(tenant, "s-up", [{"role": "user", "content": "three"}], 4, "c", parent=r2.id)
    late.started_at = r1.started_at - timedelta(seconds=60)  # a spooled step written late
    other = _record(tenant, "s-up-2", [{"role": "user", "content": "x"}], 0, "d", task="task-2")
    with db.transaction(factory) as s:
        assert write_steps(s, [r1], new_id) == 1
    with db.transaction(factory) as s:
        assert write_steps(s, [other, r2], new_id) == 2
    with db.transaction(factory) as s:
        assert write_steps(s, [late], new_id) == 1
    with factory() as s:
        rows = {x.external_id: x for x in s.scalars(select(t.Session).where(t.Session.tenant_id == tenant))}
        sess = rows["s-up"]
        assert (sess.client, sess.task_id) == ("test", "task-9")
        assert sess.started_at == r1.started_at and sess.last_step_at == r2.started_at
        assert sess.client_info == {"ua": "hermes/1.0"} and sess.labels == {"team": "a\ufffdb", "n": 2}
        assert rows["s-up-2"].task_id == "task-2" and rows["s-up-2"].id != sess.id
        seqs = s.execute(select(t.Step.seq).where(t.Step.session_id == sess.id).order_by(t.Step.seq)).scalars().all()
        assert seqs == [1, 2, 3]


def test_shared_system_prompt_stored_once(factory, tenant):
    system = "You are a careful coding agent. " * 640  # ~20 KB
    assert len(system) >= 20_000
    recs = [_record(tenant, f"s-sys-{i}", [{"role": "user", "content": f"task {i}"}], 0, "ok", system=system)
            for i in range(2)]
    with db.transaction(factory) as s:
        write_steps(s, recs, new_id)
    with factory() as s:
        n = s.scalar(select(func.count()).select_from(t.Content).where(
            t.Content.tenant_id == tenant, t.Content.kind == "system"))
        total = s.scalar(select(func.sum(t.Content.size)).where(t.Content.tenant_id == tenant))
    assert n == 1
    assert total < len(system) + 2_000


def test_fifty_turn_conversation_stores_each_message_once(factory, tenant):
    history: list[dict] = []
    recs, parent, prompt_len = [], None, 0
    for turn in range(50):
        new = [{"role": "user", "content": f"turn {turn}: please do step {turn}"}]
        history_len = len(history)
        rec = _record(tenant, "s-50", new, history_len, f"done {turn}", parent=parent,
                      prompt_ids=[turn, turn], prefix_len=prompt_len, out_ids=[100 + turn])
        recs.append(rec)
        history += new + [{"role": "assistant", "content": f"done {turn}"}]
        parent, prompt_len = rec.id, prompt_len + 3
    with db.transaction(factory) as s:
        write_steps(s, recs, new_id)
    with factory() as s:
        n_msgs = s.scalar(select(func.count()).select_from(t.Content).where(
            t.Content.tenant_id == tenant, t.Content.kind == "message"))
        steps = list(s.scalars(select(t.Step).where(t.Step.tenant_id == tenant).order_by(t.Step.seq)))
        sess = s.get(t.Session, steps[0].session_id)
        doc = session_document(s, sess)
    assert n_msgs == 50  # each user message once, not once per turn
    assert [st.seq for st in steps] == list(range(1, 51))
    assert all(len(st.message_hashes) == 1 for st in steps)
    assert all(len(st.prompt_token_ids) == 2 for st in steps)  # token history stored once too
    assert len(doc.steps[-1].tokens.prompt_token_ids) == 49 * 3 + 2


def test_tenants_do_not_share_content(factory, tenant):
    other = tenant + "-b"
    msg = [{"role": "user", "content": "same words"}]
    with db.transaction(factory) as s:
        write_steps(s, [_record(tenant, "x", msg, 0, "a"), _record(other, "x", msg, 0, "a")], new_id)
    with factory() as s:
        n = s.scalar(select(func.count()).select_from(t.Content).where(t.Content.tenant_id.in_([tenant, other]), t.Content.kind == "message"))
        sessions = s.scalar(select(func.count()).select_from(t.Session).where(t.Session.tenant_id.in_([tenant, other])))
    assert n == 2 and sessions == 2  # a tenant's rows can be forgotten without touching another's


def _atdp(*args, env):
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], env=env, capture_output=True, text=True, timeout=120)


def test_cli_db_upgrade_given_url(new_database, tmp_path):
    url = new_database()
    env = {**os.environ, "ATDP_DATABASE_URL": url, "ATDP_HOME": str(tmp_path)}
    r = _atdp("db", "upgrade", env=env)
    assert r.returncode == 0, r.stderr
    assert db.current(url) is not None
    r = _atdp("db", "current", env=env)
    assert r.stdout.strip() == db.current(url)


def test_cli_db_upgrade_embedded_default():
    from tests.conftest import outside_tmp

    tmp_path = outside_tmp("atdp-cli")
    env = {k: v for k, v in os.environ.items() if k != "ATDP_DATABASE_URL"}
    env["ATDP_HOME"] = str(tmp_path / "home")
    r = _atdp("db", "upgrade", env=env)
    assert r.returncode == 0, r.stderr
    assert "database at" in r.stdout
    assert (tmp_path / "home" / "pg" / "PG_VERSION").exists()
    r = _atdp("db", "current", env=env)  # a second process joins the same home
    assert r.returncode == 0 and r.stdout.strip() not in ("", "empty (no migration applied)")


def test_cli_keys_create_stores_hash(db_url, factory, tmp_path, tenant):
    env = {**os.environ, "ATDP_DATABASE_URL": db_url, "ATDP_HOME": str(tmp_path)}
    r = _atdp("keys", "create", "--tenant", tenant, env=env)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    from proxy.auth import hash_key, lookup_key
    with factory() as s:
        row = s.scalar(select(t.ApiKey).where(t.ApiKey.tenant_id == tenant))
        assert row.key_hash == hash_key(key) and key not in (row.key_hash, row.prefix)
        assert lookup_key(s, key).tenant == tenant
        assert lookup_key(s, key + "x") is None
