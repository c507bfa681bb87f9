"""The writer's COPY path on real PostgreSQL: what a row can hold comes back exactly, or as the old
INSERT path stored it (NUL as U+FFFD, NaN in JSON as null); tool results link; re-sent batches add nothing."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, text

from proxy.store import db
from proxy.store import tables as t
from proxy.store.ids import new_id
from proxy.store.records import ContentRow, SessionInfo, StepRecord, ToolCallRow, ToolResultRow
from proxy.store.write import write_steps

AWKWARD = 'tab\there, newline\nthere, back\\slash, "quotes", comma, {braces}, \\N, é, 🙂'
ODD_HASH = 'odd"ha,sh\\x {}\\N é🙂'  # fits varchar(64)


def _step(tenant: str, ext: str, when: datetime, **kw) -> StepRecord:
    base = dict(
        id=new_id(), session=SessionInfo(tenant_id=tenant, external_id=ext, client="test"), api="chat.completions",
        status="ok", started_at=when, model="tiny", model_version="base", token_source="engine",
        prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5], output_logprobs=[-0.25, -1.5],
        output_versions=[["base", 2]], eligibility="eligible", finish_reason="stop",
    )
    base.update(kw)
    return StepRecord(**base)


def test_awkward_values_round_trip(factory, tenant):
    now = datetime.now(UTC)
    body = {"role": "user", "content": AWKWARD}
    first = _step(
        tenant, "copy-1", now, upstream=AWKWARD, eligibility_reason=AWKWARD,
        contents=[ContentRow(hash="h-awkward", kind="message", body=body, size=99, redaction={"EMAIL": 1}),
                  ContentRow(hash="h-none", kind="tool_result", body=None, size=4),  # a tool result of null
                  ContentRow(hash="h-nul", kind="tool_result", body="NULL\x00", size=5)],
        message_hashes=["h-awkward", 'odd"hash\\x'], params={"stop": ["a\x00b"], "temperature": 0.5},
        error={"message": "bad\x00byte", "nan": math.nan}, output_logprobs=[math.nan, -math.inf],
        output_mask=[1, 0], retention_until=now + timedelta(days=3), cost=0.125, ttft_ms=1.5,
        tool_calls=[ToolCallRow(call_id="c1", name="n" * 300, arguments={"path": "a\x00b"}),
                    ToolCallRow(call_id="c1", name="again", arguments={})],  # a repeated id: the first is kept
    )
    second = _step(tenant, "copy-1", now + timedelta(seconds=1), parent_step_id=first.id, output_mask=None,
                   tool_results=[ToolResultRow(call_id="c1", result_hash="h-result", is_error=True),
                                 ToolResultRow(call_id="c1", result_hash="h-later", is_error=False)])
    # Its references to rows it does not carry are taken as stored: the cache that prepared it had
    # heard of every forget (count 0, as the database's), so they are not checked.
    with db.transaction(factory) as s:
        assert write_steps(s, [first, second], new_id, seen={tenant: 0}) == 2
    with db.transaction(factory) as s:  # the same batch again (a re-sent one): nothing new
        assert write_steps(s, [first, second], new_id, seen={tenant: 0}) == 0
    with factory() as s:
        a, b = t.get_step(s, first.id), t.get_step(s, second.id)
        content = s.get(t.Content, (tenant, "h-awkward"))
        nul = s.get(t.Content, (tenant, "h-nul"))
        nulls = s.execute(text("SELECT (SELECT jsonb_typeof(body) FROM contents WHERE tenant_id = :t AND hash = 'h-none'),"
                               " (SELECT jsonb_typeof(error) FROM steps WHERE id = :b)"), {"t": tenant, "b": second.id}).one()
        calls = list(s.scalars(select(t.ToolCall).where(t.ToolCall.step_id == first.id)))
    assert (a.seq, b.seq) == (1, 2) and a.session_id == b.session_id
    assert a.upstream == AWKWARD and a.eligibility_reason == AWKWARD
    assert content.body == body and content.redaction == {"EMAIL": 1} and content.size == 99
    assert nul.body == "NULL\ufffd" and nul.redaction == {}
    assert a.message_hashes == ["h-awkward", 'odd"hash\\x']
    assert a.params == {"stop": ["a\ufffdb"], "temperature": 0.5}
    assert a.error == {"message": "bad\ufffdbyte", "nan": None}
    assert math.isnan(a.output_logprobs[0]) and a.output_logprobs[1] == -math.inf
    assert list(a.prompt_token_ids) == [1, 2, 3] and list(a.output_token_ids) == [4, 5]
    assert a.output_mask == [1, 0] and b.output_mask is None
    assert tuple(nulls) == ("null", "null")  # JSON null, as the INSERT path stored None
    assert a.output_versions == [["base", 2]]
    assert a.retention_until == first.retention_until and a.started_at == now
    assert (a.cost, a.ttft_ms) == (0.125, 1.5)
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "n" * 256 and call.arguments == {"path": "a\ufffdb"}
    # The first result for the call links it.
    assert (call.result_step_id, call.result_hash, call.is_error) == (second.id, "h-result", True)


def test_a_batch_of_many_sessions_numbers_each_in_order(factory, tenant):
    now = datetime.now(UTC)
    recs = [_step(tenant, f"many-{i % 7}", now + timedelta(milliseconds=i)) for i in range(300)]
    with db.transaction(factory) as s:
        assert write_steps(s, recs, new_id) == 300
    with factory() as s:
        rows = s.execute(select(t.Step.id, t.Step.seq, t.Session.external_id).join(t.Session, t.Session.id == t.Step.session_id)
                         .where(t.Step.tenant_id == tenant)).all()
    seq = {sid: n for sid, n, _ in rows}
    for i in range(7):
        mine = [r.id for r in recs if r.session.external_id == f"many-{i}"]
        assert [seq[x] for x in mine] == list(range(1, len(mine) + 1))


def _dead_letters(factory, tmp_path, records: list[StepRecord]) -> list:
    """Write `records` as the recorder does (no redaction) and return the dead letters it set aside."""
    from proxy.governance.policy import TenantPolicy
    from proxy.record import deadletters
    from proxy.record.recorder import Recorder
    from proxy.record.spool import Spool

    class NoRedaction:
        def redact_many(self, items, *, with_values=False, operator=None):
            return [(v, {}) for _, v in items]

        def close(self) -> None:
            pass

    spool = Spool(tmp_path / "spool")
    rec = Recorder(secret=b"s", factory=factory, spool=spool, redactor=NoRedaction(),
                   policy_for=lambda s, t: TenantPolicy())
    rec._write(records)
    spool.close()
    return deadletters.read(tmp_path / "spool")


def test_a_record_the_database_refuses_in_a_copy_is_set_aside_and_the_rest_written(factory, tenant, tmp_path):
    """COPY raises psycopg's errors; the recorder must still see a refused *record* (and split the
    batch around it), not a lost database (which would spool and retry the batch for ever)."""
    now = datetime.now(UTC)
    good = _step(tenant, "refused-batch", now)
    bad = _step(tenant, "refused-batch", now + timedelta(seconds=1), model="m" * 300)  # the column holds 256
    (letter,) = _dead_letters(factory, tmp_path, [good, bad])
    assert letter.reason.startswith("DataError")
    with factory() as s:
        assert t.get_step(s, good.id) is not None and t.get_step(s, bad.id) is None


def test_token_arrays_come_back_exactly(factory, tenant):
    """`steps` goes in binary COPY with its arrays built from machine arrays: the int32 range's ends,
    empty arrays (not NULL), an empty mask against none, and hashes of any text come back as written."""
    from array import array

    ends = [0, 1, -1, 2**31 - 1, -(2**31), 50_000]
    full = _step(tenant, "copy-ids", datetime.now(UTC), prompt_token_ids=array("i", ends), output_token_ids=ends[::-1],
                 output_logprobs=[-0.5] * 6, output_mask=array("i", [1, 0, 1, 1, 0, 1]),
                 message_hashes=["a" * 64, ODD_HASH, ""])
    empty = _step(tenant, "copy-ids", datetime.now(UTC), prompt_token_ids=[], output_token_ids=array("i"),
                  output_logprobs=array("f"), output_mask=[], message_hashes=[], finish_reason=7)
    with db.transaction(factory) as s:
        assert write_steps(s, [full, empty], new_id) == 2
    with factory() as s:
        a, b = t.get_step(s, full.id), t.get_step(s, empty.id)
        dims = s.execute(text("SELECT array_ndims(prompt_token_ids), array_ndims(output_mask) FROM steps WHERE id = :id"),
                         {"id": empty.id}).one()
    assert list(a.prompt_token_ids) == ends and list(a.output_token_ids) == ends[::-1]
    assert list(a.output_logprobs) == [-0.5] * 6 and a.output_mask == [1, 0, 1, 1, 0, 1]
    assert a.message_hashes == ["a" * 64, ODD_HASH, ""]
    assert (list(b.prompt_token_ids), list(b.output_token_ids), list(b.output_logprobs)) == ([], [], [])
    assert b.output_mask == [] and b.message_hashes == [] and tuple(dims) == (None, None)  # '{}', as the text path wrote
    assert b.finish_reason == "7"  # an engine's number where text belongs: its digits, as text COPY stored it


def test_token_ids_the_column_cannot_hold_set_only_their_record_aside(factory, tenant, tmp_path):
    """Ids beyond 32 bits, or not numbers at all, and values a column's binary form cannot hold, fail as
    the database would refuse them (a DataError): that record is a dead letter, the batch's others are written."""
    now = datetime.now(UTC)
    good = _step(tenant, "refused-ids", now)
    too_big = _step(tenant, "refused-ids", now + timedelta(seconds=1), prompt_token_ids=[2**40, 1])
    not_ids = _step(tenant, "refused-ids", now + timedelta(seconds=2), output_token_ids=[None])
    bad_logprobs = _step(tenant, "refused-ids", now + timedelta(seconds=3), output_logprobs=["x"])
    big_count = _step(tenant, "refused-ids", now + timedelta(seconds=4), prompt_tokens=2**40)  # an integer column
    odd_time = _step(tenant, "refused-ids", now + timedelta(seconds=5), ttft_ms="soon")
    odd_count = _step(tenant, "refused-ids", now + timedelta(seconds=6), completion_tokens="many")
    bad = (too_big, not_ids, bad_logprobs, big_count, odd_time, odd_count)
    letters = _dead_letters(factory, tmp_path, [good, *bad])
    # As PostgreSQL names them when it refuses such a value in text: the class and SQLSTATE.
    assert sorted(letter.reason for letter in letters) == sorted(
        ["DataError: NumericValueOutOfRange (SQLSTATE 22003)"] * 2
        + ["DataError: InvalidTextRepresentation (SQLSTATE 22P02)"] * 4), letters
    with factory() as s:
        assert t.get_step(s, good.id) is not None
        assert all(t.get_step(s, r.id) is None for r in bad)


def test_float32_logprobs_come_back_bit_for_bit(factory, tenant):
    """The COPY writes logprobs as their float32 bits: every float32 the engine can report reads back
    as the same float (extremes and subnormals included), and NaN and infinities stay what they are."""
    import random
    import struct
    from array import array

    rng = random.Random(11)
    bits = [rng.getrandbits(32) for _ in range(20_000)]
    values = [v for v in struct.unpack(f"{len(bits)}f", struct.pack(f"{len(bits)}I", *bits)) if math.isfinite(v)]
    values += [-0.0, 0.0, 1.4e-45, -1.4e-45, 1.17549435e-38, 3.4028235e38, -3.4028235e38, -1e-7, -20.0]
    logprobs = array("f", values)  # as the capture holds them
    rec = _step(tenant, "copy-f32", datetime.now(UTC), output_token_ids=list(range(len(logprobs))),
                output_logprobs=logprobs, output_versions=[["base", len(logprobs)]])
    special = _step(tenant, "copy-f32", datetime.now(UTC), output_logprobs=array("f", [math.nan, -math.inf]))
    with db.transaction(factory) as s:
        assert write_steps(s, [rec, special], new_id) == 2
    with factory() as s:
        # read the stored float4s as their bit patterns: no float formatting on the way back
        got = s.execute(text("SELECT float4send(x) FROM unnest((SELECT output_logprobs FROM steps WHERE id = :id))"
                             " WITH ORDINALITY AS u(x, n) ORDER BY n"), {"id": rec.id}).scalars().all()
        stored = t.get_step(s, special.id).output_logprobs
    assert [bytes(b) for b in got] == [struct.pack(">f", v) for v in logprobs]
    assert math.isnan(stored[0]) and stored[1] == -math.inf


def _batches(engine, tenant: str, n: int, sessions: int = 32) -> dict[str, int]:
    """`n` batches (a step of each of `sessions` sessions, parent-linked turns) on one connection;
    then that connection's prepared statements on the partitioned tables: how often each kind of
    plan was used (read in the last batch's transaction: psycopg forgets them on a ROLLBACK)."""
    factory = db.session_factory(engine)
    parents: dict[str, str] = {}
    when = datetime.now(UTC)
    for k in range(n):
        batch = []
        for ext in (f"plan-{j}" for j in range(sessions)):
            step = _step(tenant, ext, when + timedelta(seconds=k), parent_step_id=parents.get(ext),
                         contents=[ContentRow(hash=f"h-{ext}-{k}", kind="message", body={"k": k}, size=8)],
                         tool_calls=[ToolCallRow(call_id=f"c{k}", name="read_file", arguments={})],
                         tool_results=[ToolResultRow(call_id=f"c{k - 1}", result_hash=f"h-{ext}-{k}")] if k else [])
            parents[ext] = step.id
            batch.append(step)
        with db.transaction(factory) as s:
            assert write_steps(s, batch, new_id) == sessions
            if k == n - 1:
                row = s.connection().exec_driver_sql(
                    "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0) FROM pg_prepared_statements"
                    " WHERE statement ILIKE '%%FROM steps%%' OR statement ILIKE '%%UPDATE tool_calls%%'").one()
    return {"generic": int(row[0]), "custom": int(row[1])}


def test_the_writer_plans_each_batch_for_its_sessions(db_url, tenant):
    """The writer's lookups on the day-partitioned tables get a plan made with the batch's own
    sessions (pruned to their partitions, their indexes), never a generic plan: one cached while the
    day's partition was nearly empty scanned the whole day for every batch (bench/write_path.py
    --batch 32: 0.6 -> 8 ms per batch within 6,000 steps). Other connections keep the default, as a
    read that cannot be pruned would plan every day's partition on each execution."""
    writer = db.make_engine(db_url, pool_size=1, max_overflow=0, custom_plans=True)
    other = db.make_engine(db_url, pool_size=1, max_overflow=0)
    try:
        with writer.connect() as c:
            assert c.exec_driver_sql("SHOW plan_cache_mode").scalar_one() == "force_custom_plan"
        plans = _batches(writer, tenant, 16)
        assert plans["generic"] == 0 and plans["custom"] >= 16  # prepared (psycopg: from the 5th run), planned each time
        with other.connect() as c:
            assert c.exec_driver_sql("SHOW plan_cache_mode").scalar_one() == "auto"
    finally:
        writer.dispose()
        other.dispose()


def test_the_writer_reads_by_key_in_a_table_without_statistics(every_server):
    """A day's partition has no statistics until autovacuum analyzes it, and without them a batch's
    `session_id = ANY(256 sessions)` is estimated to match every row. The writer's lookups of a
    session's last seq and of steps already stored probe a key index once per session or step, on
    either kind of connection and on every server version the suite reaches (PostgreSQL 15 and the
    embedded 18 planned a join of the same statement differently): read by session, each batch read
    every step its sessions had, which grew with their length (a temporary table, which autovacuum
    never analyzes, stands for the new day; 500 sessions of 100 steps)."""
    from proxy.store.copy import text_array
    from proxy.store.write import LAST_SEQ, STORED_STEPS

    known = [f"s{i:04d}" for i in range(0, 500, 2)]  # every other session, and two new ones
    sids = [*known, "s9998", "s9999"]
    ids = [f"{sid}-99" for sid in known[:128]] + [f"{sid}-new" for sid in known[128:]]
    params = {"sids": text_array(sids), "lo": sids[0], "hi": sids[-1], "ids": text_array(ids),
              "step_sids": text_array([i.split("-")[0] for i in ids])}
    for c, version, custom in _each_connection(every_server):
        c.exec_driver_sql("CREATE TEMP TABLE fresh_day (id text, session_id text, seq int, pad text, "
                          "PRIMARY KEY (id, session_id), UNIQUE (session_id, seq))")
        c.exec_driver_sql("INSERT INTO fresh_day SELECT 's' || to_char(mod(g, 500), 'FM0000') || '-' || "
                          "(g / 500), 's' || to_char(mod(g, 500), 'FM0000'), g / 500, repeat('x', 200) "
                          "FROM generate_series(0, 49999) g")
        # Without statistics (a new day), then with them (a day autovacuum has analyzed:
        # PostgreSQL 15 then preferred the (session_id, seq) index for a probe that also
        # named the session, and filtered all 100 steps of it).
        for analyzed in (False, True):
            if analyzed:
                c.exec_driver_sql("ANALYZE fresh_day")
            for statement, index in ((LAST_SEQ, "fresh_day_session_id_seq_key"),
                                     (STORED_STEPS, "fresh_day_pkey")):
                sql = text(statement.replace("FROM steps", "FROM fresh_day"))
                plan = "\n".join(r[0] for r in c.execute(text(f"EXPLAIN {sql.text}"), params))
                assert "Seq Scan" not in plan and "Hash" not in plan and index in plan, (
                    version, custom, analyzed, plan)
                assert "Filter" not in plan, (version, custom, analyzed, plan)  # every key in the probe
                if statement is LAST_SEQ:
                    last = dict(c.execute(sql, params).all())
                    assert last == {sid: 0 if sid > "s9" else 99 for sid in sids}
                else:
                    assert sorted(c.execute(sql, params).scalars()) == ids[:128]


def test_the_writers_tool_result_links_use_an_index_in_a_table_without_statistics(every_server):
    """The tool-result links still read by `session_id = ANY(...)` (a bound per (session, call id)
    would leave the plan to the statistics a new day lacks): on a table without them that estimate
    is every row, which a connection set up as any other may answer with a scan of the table for
    each batch; the writer's never does (`db._plan_each_execution`), on any server version."""
    from proxy.store.copy import bool_array, text_array
    from proxy.store.write import LINK_UPDATE

    sids = [f"s{i:04d}" for i in range(0, 500, 2)]
    params = {"sid": text_array(sids), "cid": text_array(["c1"] * len(sids)), "step": text_array(sids),
              "hash": text_array(sids), "err": bool_array([False] * len(sids))}
    for c, version, custom in _each_connection(every_server):
        c.exec_driver_sql("CREATE TEMP TABLE fresh_calls (session_id text, call_id text, step_id text, "
                          "result_step_id text, result_hash text, is_error boolean, pad text)")
        c.exec_driver_sql("CREATE INDEX fresh_calls_session ON fresh_calls (session_id)")
        c.exec_driver_sql("INSERT INTO fresh_calls SELECT 's' || to_char(mod(g, 500), 'FM0000'), "
                          "'c' || (g / 500), 'x', NULL, NULL, NULL, repeat('x', 200) "
                          "FROM generate_series(0, 49999) g")
        sql = text(LINK_UPDATE.replace("UPDATE tool_calls tc", "UPDATE fresh_calls tc"))
        plan = "\n".join(r[0] for r in c.execute(text(f"EXPLAIN {sql.text}"), params))
        assert c.execute(sql, params).rowcount == len(sids)  # the statement itself links each
        if custom:  # the writer's connection
            assert "Seq Scan on fresh_calls" not in plan and "fresh_calls_session" in plan, (version, plan)


def test_two_writers_on_the_same_sessions_number_every_step_once(db_url, tenant):
    """Two writer connections write batches of the same sessions at once (proxies behind a load
    balancer, one session's calls on both): the sessions upsert holds each session's row until
    commit, so each batch numbers its steps after the other's and no seq repeats."""
    import threading

    engines = [db.make_engine(db_url, pool_size=1, max_overflow=0, custom_plans=True) for _ in range(2)]
    sessions = [f"race-{j}" for j in range(4)]
    start, errors = threading.Barrier(2), []

    def writer(engine) -> None:
        factory = db.session_factory(engine)
        start.wait()
        try:
            for k in range(15):
                batch = [_step(tenant, ext, datetime.now(UTC)) for ext in (sessions if k % 2 else sessions[::-1])]
                with db.transaction(factory) as s:
                    write_steps(s, batch, new_id)
        except Exception as e:  # a repeated seq: the unique (session_id, seq) refuses the batch
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(e,)) for e in engines]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    finally:
        for e in engines:
            e.dispose()
    assert not errors, errors[:1]
    reader = db.make_engine(db_url, pool_size=1)
    try:
        with reader.connect() as c:
            rows = c.execute(text("SELECT se.external_id, array_agg(st.seq ORDER BY st.seq) FROM steps st "
                                  "JOIN sessions se ON se.id = st.session_id WHERE st.tenant_id = :t "
                                  "GROUP BY se.external_id"), {"t": tenant}).all()
    finally:
        reader.dispose()
    assert sorted(ext for ext, _ in rows) == sessions
    assert all(seqs == list(range(1, 31)) for _, seqs in rows), rows


def test_contents_go_in_statements_of_bounded_size(factory, tenant, monkeypatch):
    """A batch's contents are split into statements of about CONTENT_CHUNK_CHARS of bodies (an array
    literal is one value, which PostgreSQL caps at 1 GB); every content arrives, a larger one alone."""
    from sqlalchemy import event

    from proxy.store import write

    monkeypatch.setattr(write, "CONTENT_CHUNK_CHARS", 100)
    bodies = {f"h-chunk-{i}": {"text": "x" * (30 if i != 3 else 500)} for i in range(7)}
    step = _step(tenant, "chunks", datetime.now(UTC),
                 contents=[ContentRow(hash=h, kind="message", body=b, size=1) for h, b in bodies.items()])
    statements = []
    engine = factory.kw["bind"]

    def count(conn, cursor, statement, *_args) -> None:
        if statement.lstrip().startswith("INSERT INTO contents"):
            statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        with db.transaction(factory) as s:
            assert write_steps(s, [step], new_id) == 1
    finally:
        event.remove(engine, "before_cursor_execute", count)
    with factory() as s:
        stored = {h: s.get(t.Content, (tenant, h)).body for h in bodies}
    assert stored == bodies
    assert len(statements) == 5  # 41-character bodies two at a time: [0, 1], [2], [3] (alone, over it), [4, 5], [6]


def test_column_types_are_asked_again_after_a_refused_copy(factory, tenant):
    """Binary COPY sends each column in the type the database had when the writer asked: types that
    went stale (a migration under a running writer) fail that COPY, and the next one asks again."""
    import pytest
    from sqlalchemy.exc import DataError

    from proxy.store import copy
    from proxy.store.write import STEP_COLUMNS

    rec = _step(tenant, "stale-types", datetime.now(UTC))
    with db.transaction(factory) as s:  # the types, as the database has them
        assert write_steps(s, [_step(tenant, "stale-types", datetime.now(UTC))], new_id) == 1
    key = ("steps", tuple(STEP_COLUMNS))
    stale = list(copy._COLUMN_TYPES[key])
    stale[STEP_COLUMNS.index("seq")] = 20  # as if `seq` were still a bigint: 8 bytes where 4 are read
    copy._COLUMN_TYPES[key] = stale
    with pytest.raises(DataError), db.transaction(factory) as s:
        write_steps(s, [rec], new_id)
    assert key not in copy._COLUMN_TYPES
    with db.transaction(factory) as s:
        assert write_steps(s, [rec], new_id) == 1


def test_array_literals_read_back_as_the_values(factory):
    # The writer's per-batch parameters are built by hand (text arrays in binary, the others as
    # literals): each must read back exactly, quotes, backslashes, braces, the word NULL and None (a
    # real NULL) included, and an empty array.
    from datetime import timezone

    from proxy.store.copy import bool_array, text_array, timestamp_array

    texts = ['plain', 'a "quote"', "back\\slash", "{brace,comma}", "NULL", None, "", " spaced ", "é ✓ 日本"]
    times = [datetime(2026, 12, 3, 17, 0, 1, 234567, tzinfo=UTC),
             datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=-7, minutes=-30)))]
    flags = [True, False, None, 1, 0]
    with factory() as s:
        got = s.execute(text("SELECT CAST(:t AS text[]), CAST(:ts AS timestamptz[]), CAST(:b AS boolean[]), "
                             "CAST(:e AS text[]), 'x' = ANY(CAST(:e AS text[]))"),
                        {"t": text_array(texts), "ts": timestamp_array(times), "b": bool_array(flags),
                         "e": text_array([])}).one()
    assert got[3] == [] and got[4] is False
    assert got[0] == texts
    assert got[1] == times  # the same instants, whatever offset they were written with
    assert got[2] == [True, False, False, True, False]


def test_a_forgotten_sessions_late_step_brings_back_none_of_its_contents(factory, tenant):
    """A step of a forgotten session that arrives late (spooled, re-sent) is dropped with its content
    rows; a long text it carried for the batch stays when a kept step of that batch refers to it."""
    from proxy.governance.forget import tombstone
    from proxy.store.texts import REF

    when = datetime.now(UTC) - timedelta(minutes=1)
    shared, own = "x" * 300, {"role": "user", "content": "only the forgotten session said this"}
    tool = {"role": "tool", "tool_call_id": "c1", "content": REF + "h-shared"}
    gone = _step(tenant, "gone", when, message_hashes=["h-own", "h-tool"], contents=[
        ContentRow(hash="h-own", kind="message", body=own, size=40, encoded=True),
        ContentRow(hash="h-tool", kind="message", body=tool, size=80, encoded=True),
        ContentRow(hash="h-shared", kind="text", body=shared, size=302, encoded=True)])
    kept = _step(tenant, "kept", when, message_hashes=["h-tool"], contents=[
        ContentRow(hash="h-tool", kind="message", body=tool, size=80, encoded=True)])  # the text went with `gone`
    with db.transaction(factory) as s:
        tombstone(s, tenant, "gone")
    with db.transaction(factory) as s:
        assert write_steps(s, [gone, kept], new_id) == 1
    with factory() as s:
        stored = set(s.scalars(select(t.Content.hash).where(t.Content.tenant_id == tenant)))
    assert stored == {"h-tool", "h-shared"}
    with db.transaction(factory) as s:  # the forgotten step alone: nothing of it is written
        assert write_steps(s, [_step(tenant, "gone", when, message_hashes=["h-own2"], contents=[
            ContentRow(hash="h-own2", kind="message", body=own, size=40, encoded=True)])], new_id) == 0
    with factory() as s:
        assert set(s.scalars(select(t.Content.hash).where(t.Content.tenant_id == tenant))) == stored


def test_the_in_process_writer_plans_as_the_child_does(start_proxy, fake_upstream):
    """`ATDP_WRITER=thread` writes through a connection of its own, set up as the writer child's
    (custom plans, no sequential scans); the proxy's other reads keep PostgreSQL's defaults."""
    proxy = start_proxy([fake_upstream.url])
    assert proxy.state.settings.writer_mode == "thread"
    with proxy.state.recorder.factory() as s:
        assert s.execute(text("SHOW enable_seqscan")).scalar_one() == "off"
        assert s.execute(text("SHOW plan_cache_mode")).scalar_one() == "force_custom_plan"
    with proxy.state.factory() as s:
        assert s.execute(text("SHOW enable_seqscan")).scalar_one() == "on"
        assert s.execute(text("SHOW plan_cache_mode")).scalar_one() == "auto"


def _each_connection(every_server):
    """A connection to each server, set up as the writer's (a plan per execution) and as any other's
    (generic plans after five runs), with the server's version and which of the two it is."""
    for url in every_server:
        for custom in (True, False):
            engine = db.make_engine(url, pool_size=1, max_overflow=0, custom_plans=custom)
            try:
                with engine.connect() as c:
                    yield c, c.exec_driver_sql("SHOW server_version").scalar(), custom
            finally:
                engine.dispose()
