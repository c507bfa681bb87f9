"""Day partitions (migration 0015, proxy.store.partitions): where a session's rows live, and
retention dropping whole days instead of deleting rows (proxy.governance.forget.drop_due_days)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text

from proxy.governance import forget
from proxy.governance.policy import TenantPolicy
from proxy.store import db, partitions
from proxy.store import tables as t
from proxy.store.content import content_hash
from proxy.store.ids import new_id, uuid7_at
from proxy.store.read import session_document
from proxy.store.records import ToolCallRow, ToolResultRow
from proxy.store.write import write_steps
from tests.integration.test_store import SECRET, _record

NOW = datetime.now(UTC)  # set again before each test (_today)


@pytest.fixture(autouse=True)
def _today():
    """Each test's NOW, read when it starts, and never in a UTC day's last minute: the start-up
    makes the partitions of the day it runs in, and the test's "today" must be that day (a CI run
    that crossed midnight between import and test once failed three of these tests)."""
    global NOW
    now = datetime.now(UTC)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
    if midnight - now < timedelta(minutes=1):
        time.sleep((midnight - now).total_seconds() + 1)
    NOW = datetime.now(UTC)


def _ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)


def _session(s, tenant: str, ext: str, begun: datetime, turns: int = 2, *, last: datetime | None = None) -> str:
    """A tool-using session written as the writer writes it, its internal id minted at `begun`."""
    call = ToolCallRow(call_id=f"call-{ext}", name="read_file", arguments='{"path": "a.txt"}')
    result = {"role": "tool", "tool_call_id": call.call_id, "content": f"contents of a.txt for {ext}"}
    first = _record(tenant, ext, [{"role": "user", "content": f"read a.txt ({ext})"}], 0, "", system="be brief",
                    prompt_ids=[1, 2, 3], out_ids=[4, 5], tool_calls=[call])
    records, parent = [first], first
    for i in range(1, turns):
        r = _record(tenant, ext, [result] if i == 1 else [{"role": "user", "content": f"turn {i} of {ext}"}], 2 * i,
                    f"answer {i}", parent=parent.id, system="be brief", prompt_ids=[6, 7], prefix_len=5,
                    out_ids=[8, 9],
                    tool_results=[ToolResultRow(call_id=call.call_id, result_hash=content_hash(SECRET, result))]
                    if i == 1 else ())
        records.append(r)
        parent = r
    for i, r in enumerate(records):
        r.started_at = begun + timedelta(minutes=i)
        r.retention_until = None
    if last is not None:
        records[-1].started_at = last
    write_steps(s, records, lambda: uuid7_at(_ms(begun)))
    return s.scalar(select(t.Session.id).where(t.Session.tenant_id == tenant, t.Session.external_id == ext))


def _where(s, table: str, session_id: str) -> set[str]:
    return set(s.scalars(text(f"SELECT DISTINCT tableoid::regclass::text FROM {table} WHERE session_id = :s"),
                         {"s": session_id}))


def _policies(days: dict[str, int | None]):
    return lambda s, tenant: TenantPolicy(retention_days=days.get(tenant))


def test_a_sessions_rows_live_in_the_partition_of_its_day(own_db):
    url, factory = own_db
    with db.transaction(factory) as s:
        assert partitions.ensure(s) == []  # the start-up made today's and the days ahead
        days = partitions.day_partitions(s)
        assert [p.day for p in days] == [NOW.date() + timedelta(days=i) for i in range(partitions.AHEAD_DAYS + 1)]
        assert all(p.tables == ("steps", "tool_calls") for p in days)
        tomorrow = datetime.combine(NOW.date() + timedelta(days=1), datetime.min.time(), UTC)
        sid = _session(s, "tp", "tomorrow", tomorrow + timedelta(hours=3), turns=3)
        today = _session(s, "tp", "today", NOW)
    with factory() as s:
        stamp = f"{tomorrow:%Y%m%d}"
        assert _where(s, "steps", sid) == {f"steps_p{stamp}"}
        assert _where(s, "tool_calls", sid) == {f"tool_calls_p{stamp}"}
        assert _where(s, "steps", today) == {f"steps_p{NOW:%Y%m%d}"}
        doc = session_document(s, s.get(t.Session, sid))
        assert [st.seq for st in doc.steps] == [1, 2, 3]
        assert doc.steps[1].observation.tool_results[0].call_step_id == doc.steps[0].id
        # A read of one session searches one partition.
        plan = "\n".join(s.scalars(text("EXPLAIN SELECT * FROM steps WHERE session_id = :s"), {"s": sid}))
        assert f"steps_p{stamp}" in plan and "steps_legacy" not in plan and "steps_default" not in plan


def test_a_resent_batch_is_found_across_partitions(own_db):
    _, factory = own_db
    with db.transaction(factory) as s:
        when = datetime.combine(NOW.date() + timedelta(days=2), datetime.min.time(), UTC)
        r = _record("tp", "again", [{"role": "user", "content": "hi"}], 0, "hello")
        assert write_steps(s, [r], lambda: uuid7_at(_ms(when))) == 1
        assert write_steps(s, [r], new_id) == 0  # the spool re-sends it: nothing new
        assert s.scalar(text("SELECT count(*) FROM steps WHERE id = :i"), {"i": r.id}) == 1


def test_retention_drops_a_due_day_and_keeps_the_rest(own_db):
    """A day 40 days back, its tenants keeping 30 days: its partitions go whole (no DELETE of its
    steps), with its sessions, feedback, lineage and the contents only it used; the audit counts
    them. A tenant that keeps forever holds its day; a day not yet due stays; today is untouched."""
    _, factory = own_db
    old = NOW - timedelta(days=40)
    held = NOW - timedelta(days=41)
    recent = NOW - timedelta(days=20)
    policy = _policies({"ta": 30, "tb": 30})  # tc keeps forever
    with db.transaction(factory) as s:
        for when in (old, held, recent):
            partitions.ensure(s, today=when.date(), ahead=0)
        gone = [_session(s, "ta", "a-old-1", old), _session(s, "ta", "a-old-2", old + timedelta(minutes=5)),
                _session(s, "tb", "b-old", old + timedelta(minutes=9))]
        keep_held = [_session(s, "ta", "a-held", held), _session(s, "tc", "c-held", held)]
        keep_recent = _session(s, "ta", "a-recent", recent)
        keep_today = _session(s, "ta", "a-today", NOW)
        vid = new_id()
        s.add(t.ModelVersion(id=vid, name="v-part", checkpoint="/ckpt", status="serving"))
        s.flush()
        trained = s.scalar(select(t.Step.id).where(t.Step.session_id == gone[0], t.Step.seq == 1))
        s.add(t.VersionLineage(version_id=vid, step_id=trained, session_id=gone[0]))
        s.add(t.Feedback(id=new_id(), session_id=gone[1], tenant_id="ta", reward=1.0, source="rule"))
        shared = s.scalar(select(t.Step.system_hash).where(t.Step.session_id == gone[0]).limit(1))
        only_old = s.scalar(select(t.Step.output_hash).where(t.Step.session_id == gone[2], t.Step.seq == 2))
    with db.transaction(factory) as s:
        reports = {r.tenant: r for r in forget.run_retention(s, policy_for=policy, now=NOW)}
    day = old.date().isoformat()
    a, b = reports["ta"], reports["tb"]
    assert a.partitions == [day] and b.partitions == [day]
    # ta: the two sessions of the dropped day, and its session of the held day by row (it is 41 days old).
    assert (a.sessions, a.steps, a.tool_calls, a.feedback, a.lineage) == (3, 6, 3, 1, {vid: 1})
    assert len(a.step_ids) == 2  # the row path lists the step ids it forgot (for the caches); a dropped day does not
    assert (b.sessions, b.steps, b.tool_calls) == (1, 2, 1)
    assert a.tokens == 3 * (3 + 2 + 2 + 2)
    with factory() as s:
        names = set(s.scalars(text("SELECT relname FROM pg_class WHERE relkind IN ('r', 'p')")))
        stamp = f"{old:%Y%m%d}"
        assert f"steps_p{stamp}" not in names and f"tool_calls_p{stamp}" not in names
        assert f"steps_p{held:%Y%m%d}" in names and f"steps_p{recent:%Y%m%d}" in names
        left = set(s.scalars(select(t.Session.id)))
        assert not left & {*gone, keep_held[0]} and {keep_held[1], keep_recent, keep_today} <= left
        assert s.scalar(select(t.Step.id).where(t.Step.session_id.in_(gone))) is None
        assert s.scalar(text("SELECT count(*) FROM version_lineage")) == 0
        stored = set(s.scalars(select(t.Content.hash).where(t.Content.tenant_id == "tb")))
        assert only_old not in stored  # used by the dropped day alone
        assert shared in set(s.scalars(select(t.Content.hash).where(t.Content.tenant_id == "ta")))  # still used
        audit = s.scalars(select(t.AuditEvent.details).where(t.AuditEvent.action == "retention.forget",
                                                             t.AuditEvent.tenant_id == "ta")).one()
        assert audit["partitions"] == [day] and audit["sessions"] == 3
        # Every remaining session still reads whole.
        for sid in [keep_held[1], keep_recent, keep_today]:
            assert len(session_document(s, s.get(t.Session, sid)).steps) == 2


def test_a_day_is_dropped_only_when_its_start_is_due(own_db):
    """Sessions go between zero and one day before their own deadline, never after: a day whose
    start is 29.9 days back under a 30-day policy stays, and the row-by-row path does not take its
    sessions either (their steps are within 30 days)."""
    _, factory = own_db
    day = (NOW - timedelta(days=29, hours=22)).date()
    begun = datetime.combine(day, datetime.min.time(), UTC) + timedelta(hours=1)
    with db.transaction(factory) as s:
        partitions.ensure(s, today=day, ahead=0)
        sid = _session(s, "ta", "edge", begun)
    start = datetime.combine(day, datetime.min.time(), UTC)
    with db.transaction(factory) as s:
        assert forget.run_retention(s, policy_for=_policies({"ta": 30}), now=start + timedelta(days=30) - timedelta(seconds=1)) == []
        assert s.get(t.Session, sid) is not None
    with db.transaction(factory) as s:
        [report] = forget.run_retention(s, policy_for=_policies({"ta": 30}), now=start + timedelta(days=30))
        assert report.partitions == [day.isoformat()] and report.sessions == 1
        assert s.get(t.Session, sid) is None


def test_an_active_session_of_a_due_day_is_forgotten_by_row_first(own_db):
    """A session of a due day that took a step within the continuation window may still be linked by
    a proxy's memory: it is forgotten row by row (its step ids reach the caches), then the day goes."""
    _, factory = own_db
    old = NOW - timedelta(days=40)
    with db.transaction(factory) as s:
        partitions.ensure(s, today=old.date(), ahead=0)
        quiet = _session(s, "ta", "quiet", old)
        active = _session(s, "ta", "active", old + timedelta(minutes=1), last=NOW - timedelta(hours=1))
        active_steps = set(s.scalars(select(t.Step.id).where(t.Step.session_id == active)))
    with db.transaction(factory) as s:
        [report] = forget.run_retention(s, policy_for=_policies({"ta": 30}), now=NOW, quiet_s=24 * 3600)
    assert set(report.step_ids) == active_steps  # the quiet session's ids are not sent: no cache can use them
    assert report.sessions == 2 and report.partitions == [old.date().isoformat()]
    with factory() as s:
        assert s.get(t.Session, quiet) is None and s.get(t.Session, active) is None


def test_an_empty_past_day_is_dropped_and_the_days_ahead_stay(own_db):
    _, factory = own_db
    gone = (NOW - timedelta(days=3)).date()
    with db.transaction(factory) as s:
        partitions.ensure(s, today=gone, ahead=0)
        forget.run_retention(s, policy_for=_policies({}), now=NOW)
        left = [p.day for p in partitions.day_partitions(s)]
    assert gone not in left and NOW.date() + timedelta(days=1) in left


def test_the_migration_keeps_recorded_data_in_place_and_back(new_database):
    """A database with data at 0014: 0015 makes its tables the legacy partitions (rows not copied),
    the views see old and new rows alike, and the downgrade puts every row back in plain tables."""
    url = new_database("atdp_mig")
    db.upgrade(url, "0014")
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    try:
        with db.transaction(factory) as s:
            # Today's writer counts forgets (0016) and names each step's layers (0017): lent the
            # columns while it writes the 0014 data.
            s.execute(text("ALTER TABLE tenants ADD COLUMN forgets bigint NOT NULL DEFAULT 0"))
            s.execute(text("ALTER TABLE steps ADD COLUMN harness_version varchar(36), "
                           "ADD COLUMN memory_version varchar(36), ADD COLUMN memory_facts varchar(36)[]"))
            before = _session(s, "tm", "before", NOW - timedelta(days=3), turns=3)
            s.execute(text("ALTER TABLE tenants DROP COLUMN forgets"))
            s.execute(text("ALTER TABLE steps DROP COLUMN harness_version, DROP COLUMN memory_version, "
                           "DROP COLUMN memory_facts"))
        db.upgrade(url)
        with db.transaction(factory) as s:
            assert _where(s, "steps", before) == {"steps_legacy"}
            assert _where(s, "tool_calls", before) == {"tool_calls_legacy"}
            assert [p.day for p in partitions.day_partitions(s)][0] == NOW.date() + timedelta(days=1)
            tomorrow = datetime.combine(NOW.date() + timedelta(days=1), datetime.min.time(), UTC)
            after = _session(s, "tm", "after", tomorrow + timedelta(minutes=1))
            assert _where(s, "steps", after) == {f"steps_p{tomorrow:%Y%m%d}"}
            seen = dict(s.execute(text("SELECT session_id, count(*) FROM atdp_steps_readable GROUP BY session_id")).all())
            assert seen == {"before": 3, "after": 2}  # the view names sessions by their public ids
            assert len(session_document(s, s.get(t.Session, before)).steps) == 3
        db.downgrade(url, "0014")
        with factory() as s:
            assert s.scalar(text("SELECT relkind FROM pg_class WHERE relname = 'steps'")) == "r"
            assert s.scalar(text("SELECT count(*) FROM steps")) == 5
            assert s.scalar(text("SELECT count(*) FROM tool_calls")) == 2
            assert s.scalar(text("SELECT count(*) FROM atdp_steps_readable")) == 5
        db.upgrade(url)
    finally:
        engine.dispose()


def test_a_day_made_too_late_moves_out_of_the_default_partition_and_is_dropped_whole(own_db, caplog):
    """Sessions minted on a day that had no partition (no proxy ran for over a week) land in the
    default partition. PostgreSQL refuses to create a partition whose range the default holds rows of,
    so the next upkeep moves the day's rows into a new partition and attaches it: the sessions read
    whole from there, writes go on, and retention drops the day like any other."""
    _, factory = own_db
    old = NOW - timedelta(days=40)
    with db.transaction(factory) as s:
        sid = _session(s, "ta", "late", old, turns=3)
        other = _session(s, "ta", "late-next-day", old + timedelta(days=1), turns=2)
        assert _where(s, "steps", sid) == _where(s, "steps", other) == {"steps_default"}
        assert _where(s, "tool_calls", sid) == {"tool_calls_default"}
    with db.transaction(factory) as s:
        created = partitions.ensure(s)  # today's upkeep finds the two stranded days
    stamps = [f"{old:%Y%m%d}", f"{old + timedelta(days=1):%Y%m%d}"]
    assert created == [f"{tbl}_p{d}" for d in stamps for tbl in ("steps", "tool_calls")]
    assert "moved 3 rows of the sessions begun" in caplog.text
    with factory() as s:
        assert _where(s, "steps", sid) == {f"steps_p{stamps[0]}"}
        assert _where(s, "tool_calls", sid) == {f"tool_calls_p{stamps[0]}"}
        assert _where(s, "steps", other) == {f"steps_p{stamps[1]}"}
        assert s.scalar(text("SELECT count(*) FROM steps_default")) == 0
        doc = session_document(s, s.get(t.Session, sid))
        assert [st.seq for st in doc.steps] == [1, 2, 3]
        assert doc.steps[1].observation.tool_results[0].call_step_id == doc.steps[0].id
        # The moved partition has the parent's keys: a duplicate step is refused.
        with pytest.raises(Exception, match="duplicate key"):
            s.execute(text(f"INSERT INTO steps_p{stamps[0]} SELECT * FROM steps WHERE session_id = :s LIMIT 1"),
                      {"s": sid})
        s.rollback()
    with db.transaction(factory) as s:
        assert partitions.ensure(s) == []  # nothing left to move
        [report] = forget.run_retention(s, policy_for=_policies({"ta": 30}), now=NOW)
    assert (report.sessions, report.steps) == (2, 5)
    assert report.partitions == [old.date().isoformat(), (old + timedelta(days=1)).date().isoformat()]
    with factory() as s:
        assert [p.day for p in partitions.day_partitions(s)][0] == NOW.date()


def test_a_stranded_day_whose_default_is_locked_waits_for_the_next_run(own_db, caplog):
    """A writer holding the default partition longer than 5 s: the move gives up, the rows stay where
    they are and read whole, and the next run moves them."""
    _, factory = own_db
    old = NOW - timedelta(days=40)
    with db.transaction(factory) as s:
        sid = _session(s, "tb", "locked", old, turns=2)
    with factory() as holder:
        holder.execute(text("LOCK TABLE steps_default IN ROW EXCLUSIVE MODE"))
        with db.transaction(factory) as s:
            created = partitions.ensure(s)
        assert f"steps_p{old:%Y%m%d}" not in created and "stay in steps_default for now" in caplog.text
        holder.rollback()
    with factory() as s:
        assert _where(s, "steps", sid) == {"steps_default"}
        assert _where(s, "tool_calls", sid) == {f"tool_calls_p{old:%Y%m%d}"}  # that table's move went through
    # Half a day is not dropped: retention forgets its sessions by row.
    with db.transaction(factory) as s:
        assert forget.due_days(s, policy_for=_policies({"tb": 30}), now=NOW) == []
    with db.transaction(factory) as s:
        assert f"steps_p{old:%Y%m%d}" in partitions.ensure(s)
    with factory() as s:
        assert _where(s, "steps", sid) == {f"steps_p{old:%Y%m%d}"}
        assert len(session_document(s, s.get(t.Session, sid)).steps) == 2


def test_a_day_whose_lock_is_held_is_left_whole_for_the_next_run(own_db):
    """The drop waits at most 5 s for `steps`' lock: behind a long reader, the due day is left with
    everything it holds (its sessions, their contents), the row-by-row part of the run is kept, and
    the next run drops the day."""
    _, factory = own_db
    old = NOW - timedelta(days=40)
    with db.transaction(factory) as s:
        partitions.ensure(s, today=old.date(), ahead=0)
        in_day = _session(s, "ta", "in-day", old)
        by_row = _session(s, "ta", "by-row", NOW - timedelta(days=35))  # no day partition: the default one
    reader = factory()
    reader.execute(text("SELECT count(*) FROM steps WHERE session_id = :s"), {"s": in_day})  # holds its lock
    try:
        with db.transaction(factory) as s:
            [report] = forget.run_retention(s, policy_for=_policies({"ta": 30}), now=NOW)
    finally:
        reader.rollback()
        reader.close()
    assert report.partitions == [] and report.sessions == 1
    with factory() as s:
        assert s.get(t.Session, by_row) is None
        assert len(session_document(s, s.get(t.Session, in_day)).steps) == 2  # whole, contents included
    with db.transaction(factory) as s:
        [report] = forget.run_retention(s, policy_for=_policies({"ta": 30}), now=NOW)
    assert report.partitions == [old.date().isoformat()] and report.sessions == 1


@pytest.mark.parametrize("locale", [
    "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'",  # punctuation sorts before digits
    "LOCALE 'en_US.UTF-8'",  # glibc ignores punctuation at first (the postgres image's default)
], ids=["icu-en-US", "glibc-en_US"])
def test_ids_find_their_day_under_other_collations(new_database, pg_admin_url, locale):
    """The day ranges compare session ids as text in the database's collation: under ICU's and
    glibc's en-US canonical UUIDs keep their C order (the hyphens stand at the same places), so ids
    minted a millisecond either side of midnight land in their own days. Skipped where the server
    lacks the collation."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError

    url = new_database("atdp_icu")
    name = make_url(url).database
    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE "{name}"')
            try:
                c.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE template0 {locale}')
            except DBAPIError as e:
                c.exec_driver_sql(f'CREATE DATABASE "{name}"')  # the fixture drops it at the end
                pytest.skip(f"this PostgreSQL lacks the collation ({type(e.orig).__name__}: {e.orig})")
    finally:
        admin.dispose()
    db.upgrade(url)
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    try:
        with db.transaction(factory) as s:
            assert s.scalar(text("SELECT datcollate FROM pg_database WHERE datname = current_database()")) != "C"
            midnight = datetime.combine(NOW.date() + timedelta(days=2), datetime.min.time(), UTC)
            cases = {"before": midnight - timedelta(milliseconds=1), "at": midnight,
                     "noon": midnight + timedelta(hours=12), "late": midnight + timedelta(days=1, hours=23, minutes=59)}
            sids = {name: _session(s, "ti", name, when, turns=1) for name, when in cases.items()}
        with factory() as s:
            for name, when in cases.items():
                assert _where(s, "steps", sids[name]) == {f"steps_p{when:%Y%m%d}"}, name
    finally:
        engine.dispose()
