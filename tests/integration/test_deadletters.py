"""What still goes wrong is visible and governed: the catch-all 500, and dead letters.

- An exception no route expected is a 500 in the called API's shape (not plain text, not a reset
  connection), the call is a failed step, and the log has the traceback without request values. The
  scripted upstream sends an answer no engine sends (`#malformed`), the only way to reach that path.
- A step the database refuses (here: an over-long session id or model name, which the doors now
  refuse with a 400) is set aside as a dead letter by the real recorder; `atdp deadletters
  list|replay|purge` sees, retries and deletes it; forget and retention purge it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from sqlalchemy import select

from proxy.config import spool_folder
from proxy.record import deadletters
from proxy.record.spool import Spool, claim_folder
from proxy.store import tables as t
from proxy.store.ids import new_id
from proxy.store.records import SessionInfo, StepRecord

MARK = "PII-MARK-0815"
ADMIN = {"authorization": "Bearer admin-test-key"}


def test_an_unexpected_exception_is_a_500_in_the_callers_shape_and_a_failed_step(
        start_proxy, fake_upstream, factory, caplog):
    proxy = start_proxy([fake_upstream.url])
    caplog.set_level(logging.ERROR, logger="atdp.http")
    text = f"#malformed {MARK}"
    oai = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as chat:
        oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": text}])
    with pytest.raises(openai.InternalServerError) as resp:
        oai.responses.create(model="fake", input=text)
    ant = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as msg:
        ant.messages.create(model="fake", max_tokens=10, messages=[{"role": "user", "content": text}])

    for e in (chat, resp):
        body = e.value.response.json()
        assert set(body) == {"error"} and body["error"]["type"] == "server_error"
    body = msg.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    step_ids = [e.value.response.headers["x-atdp-step-id"] for e in (chat, resp, msg)]
    steps = {s.id: s for s in proxy.steps(factory)}
    for sid in step_ids:
        assert steps[sid].status == "error" and steps[sid].error["type"] == "internal_error"
    # The traceback is logged, the request's values are not.
    assert caplog.text.count("Traceback") >= 3 and MARK not in caplog.text
    for e in (chat, resp, msg):
        assert MARK not in e.value.response.text


# --- dead letters ----------------------------------------------------------------------------------


def refused_record(tenant: str, session: str, *, model: str = "tiny", days_ago: float = 0.0) -> StepRecord:
    return StepRecord(id=new_id(), session=SessionInfo(tenant_id=tenant, external_id=session),
                      api="chat.completions", status="ok", model=model,
                      started_at=datetime.now(UTC) - timedelta(days=days_ago))


def set_aside(proxy: Any, record: StepRecord) -> None:
    """Hand a record to the proxy's own recorder write path, as the writer does."""
    proxy.state.recorder._write([record])


def atdp(proxy: Any, db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ATDP_HOME": str(proxy.state.settings.home), "ATDP_DATABASE_URL": db_url}
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def lines(out: str) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in out.splitlines() if x.strip()]


def test_what_the_doors_now_refuse_would_have_been_a_dead_letter(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    long_id = "s" * 300
    r = httpx.post(proxy.v1 + "/chat/completions", headers={"x-atdp-session-id": long_id},
                   json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-ATDP-Session-Id"
    assert fake_upstream.requests == []  # refused before the upstream
    proxy.flush()
    assert deadletters.read(proxy.state.settings.spool_dir) == []
    # The same step, past the door: the database refuses it, and it is set aside.
    set_aside(proxy, refused_record(proxy.tenant, long_id))
    (letter,) = deadletters.read(proxy.state.settings.spool_dir)
    assert letter.session == long_id and letter.reason.startswith("DataError")


def test_a_model_made_overlong_tool_name_is_stored_not_set_aside(start_proxy, fake_upstream, factory):
    """What the client cannot be blamed for (the model's own tool call) must not make a dead letter."""
    proxy = start_proxy([fake_upstream.url])
    name = "tool_" + "n" * 300
    c = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"#tool {name} {{}}"}])
    assert r.choices[0].message.tool_calls[0].function.name == name  # the client gets it whole
    (step,) = proxy.steps(factory)
    assert deadletters.read(proxy.state.settings.spool_dir) == []
    with factory() as s:
        (call,) = s.scalars(select(t.ToolCall).where(t.ToolCall.step_id == step.id))
    assert call.name == name[:256]


def test_deadletters_cli_lists_replays_and_purges(start_proxy, fake_upstream, db_url, factory):
    proxy = start_proxy([fake_upstream.url])
    bad = refused_record(proxy.tenant, "dl-" + "x" * 300)
    set_aside(proxy, bad)
    # A letter set aside earlier for a cause since fixed (the record itself is fine): replay stores it.
    good = refused_record(proxy.tenant, "dl-good")
    proxy.state.recorder.spool.reject([good.to_json()], reason="OperationalError: an earlier refusal")

    listed = atdp(proxy, db_url, "deadletters", "list")
    assert listed.returncode == 0, listed.stderr
    rows = {x["step_id"]: x for x in lines(listed.stdout)}
    assert set(rows) == {bad.id, good.id}
    assert rows[bad.id]["tenant"] == proxy.tenant and rows[bad.id]["reason"].startswith("DataError")
    assert set(rows[good.id]) == {"step_id", "tenant", "session", "api", "status", "started_at", "reason", "file"}

    replayed = atdp(proxy, db_url, "deadletters", "replay")
    assert replayed.returncode == 1  # one still refused
    result = orjson.loads(replayed.stdout)
    assert result["written"] == [good.id] and [f["step_id"] for f in result["failed"]] == [bad.id]
    with factory() as s:
        assert t.get_step(s, good.id) is not None and t.get_step(s, bad.id) is None
    assert [x["step_id"] for x in lines(atdp(proxy, db_url, "deadletters", "list").stdout)] == [bad.id]

    assert atdp(proxy, db_url, "deadletters", "purge").returncode == 2  # needs --all or a filter
    purged = atdp(proxy, db_url, "deadletters", "purge", "--step", bad.id)
    assert orjson.loads(purged.stdout) == {"purged": 1, "step_ids": [bad.id]}
    assert atdp(proxy, db_url, "deadletters", "list").stdout == ""


def test_deadletters_cli_and_forget_cover_every_workers_folder(start_proxy, fake_upstream, db_url):
    """`atdp serve --workers N` sets refused steps aside per worker (spool/worker-K/rejected): the
    command line lists, purges and forgets across all of them, not only the folder of a single proxy."""
    proxy = start_proxy([fake_upstream.url])
    spool = proxy.state.settings.spool_dir
    records = {k: refused_record(proxy.tenant, f"dl-w{k}") for k in (0, 2, 3)}
    for k, rec in records.items():
        Spool(spool / f"worker-{k}" if k else spool).reject([rec.to_json()], reason="DataError: test")
    listed = atdp(proxy, db_url, "deadletters", "list")
    assert listed.returncode == 0, listed.stderr
    assert sorted(x["session"] for x in lines(listed.stdout)) == ["dl-w0", "dl-w2", "dl-w3"]
    purged = atdp(proxy, db_url, "deadletters", "purge", "--session", "dl-w2")
    assert orjson.loads(purged.stdout)["step_ids"] == [records[2].id]
    forgot = atdp(proxy, db_url, "forget", "--session", "dl-w3", "--tenant", proxy.tenant)
    assert forgot.returncode == 0, forgot.stderr
    assert orjson.loads(forgot.stdout)["dead_letters"] == 1  # a session only dead letters hold, in worker 3's
    assert [x["session"] for x in lines(atdp(proxy, db_url, "deadletters", "list").stdout)] == ["dl-w0"]


def test_forget_purges_a_sessions_and_a_tenants_dead_letters(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url])
    spool = proxy.state.settings.spool_dir
    # Every step of this session was refused (model name too long): it has no row, only dead letters.
    set_aside(proxy, refused_record(proxy.tenant, "dl-forget", model="m" * 300))
    set_aside(proxy, refused_record(proxy.tenant, "dl-forget", model="m" * 300))
    set_aside(proxy, refused_record(proxy.tenant, "dl-keep", model="m" * 300))
    set_aside(proxy, refused_record("other-tenant", "dl-forget", model="m" * 300))
    r = httpx.delete(proxy.url + "/atdp/v1/sessions/dl-forget")  # the open-mode tenant's own key
    assert r.status_code == 200 and r.json()["dead_letters"] == 2
    assert sorted((d.tenant, d.session) for d in deadletters.read(spool)) == [
        ("other-tenant", "dl-forget"), (proxy.tenant, "dl-keep")]
    assert httpx.delete(proxy.url + "/atdp/v1/sessions/dl-forget").status_code == 404  # nothing left
    r = httpx.delete(proxy.url + f"/atdp/v1/tenants/{proxy.tenant}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["dead_letters"] == 1
    assert [(d.tenant, d.session) for d in deadletters.read(spool)] == [("other-tenant", "dl-forget")]
    with factory() as s:
        assert s.scalar(select(t.AuditEvent).where(t.AuditEvent.tenant_id == proxy.tenant,
                                                   t.AuditEvent.action == "forget.tenant")) is not None


def test_a_forget_through_the_api_purges_the_dead_letters_a_stopped_replica_left(start_proxy, fake_upstream, tmp_path):
    """`--scale proxy=3` then 2: the replica scaled away may have left dead letters in its folder. A forget
    through a remaining proxy purges them (the folder held meanwhile); a live replica's folder is left to
    that replica's own forget follower."""
    home = tmp_path / "served"
    _, own = claim_folder(lambda k: spool_folder(home, k), 0)  # as `atdp serve` holds its folder
    holder = None
    try:
        proxy = start_proxy([fake_upstream.url], home=home)
        for k in (1, 2):
            Spool(spool_folder(home, k)).reject([refused_record(proxy.tenant, "dl-gone").to_json()],
                                                reason="DataError: test")
        _, holder = claim_folder(lambda k: spool_folder(home, k), 2)  # worker 2's replica is running
        r = httpx.delete(proxy.url + "/atdp/v1/sessions/dl-gone")
        assert r.status_code == 200 and r.json()["dead_letters"] == 1, r.text
        assert deadletters.read(spool_folder(home, 1)) == []
        assert [d.session for d in deadletters.read(spool_folder(home, 2))] == ["dl-gone"]
    finally:
        for fd in (own, holder):
            if fd is not None:
                os.close(fd)


def test_retention_expires_dead_letters(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url])
    spool = proxy.state.settings.spool_dir
    r = httpx.put(proxy.url + f"/atdp/v1/tenants/{proxy.tenant}/policy", json={"retention_days": 7}, headers=ADMIN)
    assert r.status_code == 200, r.text
    old = refused_record(proxy.tenant, "dl-old", model="m" * 300, days_ago=10)
    recent = refused_record(proxy.tenant, "dl-recent", model="m" * 300, days_ago=1)
    default = refused_record(f"{proxy.tenant}-b", "dl-old", model="m" * 300, days_ago=30)  # the default: 90 days
    for rec in (old, recent, default):
        set_aside(proxy, rec)
    assert httpx.post(proxy.url + "/atdp/v1/retention/run", headers=ADMIN).status_code == 200
    assert sorted(d.step_id for d in deadletters.read(spool)) == sorted([recent.id, default.id])


def test_a_dead_letters_reason_never_quotes_the_row(start_proxy, fake_upstream, caplog):
    """PostgreSQL quotes the refused row's values (`DETAIL: Key (replay_of)=(...)`); the reason kept
    beside the dead letter, and the log line, are the error's type and SQLSTATE only (#13)."""
    proxy = start_proxy([fake_upstream.url])
    mark = "acct-4111111111111111-x"
    record = refused_record(proxy.tenant, "dl-quoted")
    record.session.replay_of = mark  # no such session: a foreign-key refusal that quotes the value
    set_aside(proxy, record)
    (letter,) = [d for d in deadletters.read(proxy.state.settings.spool_dir) if d.session == "dl-quoted"]
    assert letter.reason == "IntegrityError: ForeignKeyViolation (SQLSTATE 23503)"
    raw = b"".join(p.read_bytes() for p in deadletters.folder(proxy.state.settings.spool_dir).iterdir())
    assert raw.count(mark.encode()) == 1  # only the record's own (redacted-form) field, not the reason
    assert mark not in caplog.text
