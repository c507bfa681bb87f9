"""Writing ATDP records: a batch of redacted step records in one transaction.

A `StepRecord` (`proxy.store.records`) is what leaves the redaction stage: every text in it is
already redacted, so it may go to PostgreSQL or, when the database is away, to the spool.
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
import psycopg
from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from proxy.store import tables as t
from proxy.store.copy import (
    binary_float4s,
    binary_int4s,
    binary_texts,
    bool_array,
    copy_rows,
    copy_rows_binary,
    int_array,
    json_text,
    jsonb,
    text_array,
    timestamp_array,
)
from proxy.store.forgets import check_references, lock_tenants
from proxy.store.records import NOT_COLUMNS, ContentRow, StepRecord
from proxy.store.texts import ENCODED_KINDS, escape, refs

log = logging.getLogger("atdp.store")


def pg_safe(value: Any) -> Any:
    """PostgreSQL text and JSONB cannot hold NUL characters; models can emit them. Store U+FFFD.
    JSONB has no NaN or infinity either: those are stored as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {pg_safe(k): pg_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [pg_safe(v) for v in value]
    return value


def _has_nul(value: Any) -> bool:
    return b"\\u0000" in orjson.dumps(value)


def _json(value: Any) -> str:
    """A JSON document as text (for a `CAST(... AS jsonb)` over an array parameter)."""
    raw = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    return (orjson.dumps(pg_safe(value), option=orjson.OPT_NON_STR_KEYS) if b"\\u0000" in raw else raw).decode()


def ensure_tenant(s: Session, tenant_id: str) -> None:
    s.execute(insert(t.Tenant).values(id=tenant_id).on_conflict_do_nothing())


def _aware(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


TOMBSTONES = """
SELECT tenant_id, external_id, max(forgotten_at) FROM tombstones
 WHERE tenant_id = ANY(CAST(:tenants AS text[]))
   AND (external_id IS NULL OR external_id = ANY(CAST(:names AS text[])))
 GROUP BY tenant_id, external_id"""


def not_forgotten(s: Session, records: list[StepRecord]) -> list[StepRecord]:
    """`records` less the steps of forgotten sessions (or tenants) that started before the forget:
    a step spooled, queued or re-sent by the writer while its session was forgotten never comes back.
    A step started after the forget (a client reusing its session id) is new data and is kept."""
    if not records:
        return records
    tenants = sorted({r.session.tenant_id for r in records})
    names = sorted({r.session.external_id for r in records})
    rows = s.execute(text(TOMBSTONES), {"tenants": text_array(tenants), "names": text_array(names)}).all()
    if not rows:
        return records
    forgotten = {(tenant, ext): at for tenant, ext, at in rows}

    def gone(r: StepRecord) -> bool:
        started = _aware(r.started_at)
        return any(at is not None and started < at for at in (
            forgotten.get((r.session.tenant_id, r.session.external_id)), forgotten.get((r.session.tenant_id, None))))

    kept = [r for r in records if not gone(r)]
    if len(kept) < len(records):
        log.info("dropped %d step(s) of forgotten sessions", len(records) - len(kept))
    return kept


# The batch's new contents in one statement over array parameters (`copy.text_array`), in key
# order (the writers' lock order). One row per execution, pipelined, cost the writer about a sixth
# of its CPU per step, and PostgreSQL an executor start per row.
CONTENT_INSERT = """
INSERT INTO contents (tenant_id, hash, kind, body, size, redaction)
SELECT tenant, hash, kind, CAST(body AS jsonb), size, CAST(redaction AS jsonb)
  FROM unnest(CAST(:tenant AS text[]), CAST(:hash AS text[]), CAST(:kind AS text[]), CAST(:body AS text[]),
              CAST(:size AS integer[]), CAST(:redaction AS text[]))
       WITH ORDINALITY AS v(tenant, hash, kind, body, size, redaction, n)
 ORDER BY n
ON CONFLICT DO NOTHING"""
# Bodies per contents statement: an array parameter is one value, and PostgreSQL refuses any over 1 GB.
CONTENT_CHUNK_CHARS = 16 * 2**20
CALL_COLUMNS = ("step_id", "call_id", "session_id", "tenant_id", "name", "arguments")
LINK_UPDATE = """
UPDATE tool_calls tc SET result_step_id = v.step_id, result_hash = v.hash, is_error = v.err
  FROM unnest(CAST(:sid AS text[]), CAST(:cid AS text[]), CAST(:step AS text[]), CAST(:hash AS text[]),
              CAST(:err AS boolean[])) AS v(session_id, call_id, step_id, hash, err)
 WHERE tc.session_id = v.session_id AND tc.call_id = v.call_id AND tc.result_step_id IS NULL
   AND tc.session_id = ANY(CAST(:sid AS text[]))"""  # planned for those sessions' day partitions only
# The batch's tenants, made, and their forget counts (proxy.store.forgets); a tenant made here is not
# in the select's snapshot: it has had no forget.
TENANTS = ("WITH made AS (INSERT INTO tenants (id) SELECT unnest(CAST(:ids AS text[])) ON CONFLICT DO NOTHING) "
           "SELECT id, forgets FROM tenants WHERE id = ANY(CAST(:ids AS text[]))")
# One row per (tenant, external id), in key order (the writers' lock order); a session seen before
# keeps its first client and task and moves its last step time forward.
SESSION_UPSERT = """
INSERT INTO sessions (id, tenant_id, external_id, client, client_info, task_id, labels, started_at, last_step_at,
                      replay_of)
SELECT id, tenant, ext, client, CAST(info AS jsonb), task, CAST(labels AS jsonb), started, last, replay_of
  FROM unnest(CAST(:id AS text[]), CAST(:tenant AS text[]), CAST(:ext AS text[]), CAST(:client AS text[]),
              CAST(:info AS text[]), CAST(:task AS text[]), CAST(:labels AS text[]),
              CAST(:started AS timestamptz[]), CAST(:last AS timestamptz[]), CAST(:replay_of AS text[]))
       WITH ORDINALITY AS v(id, tenant, ext, client, info, task, labels, started, last, replay_of, n)
 ORDER BY n
ON CONFLICT ON CONSTRAINT uq_sessions_tenant_external DO UPDATE SET
   last_step_at = greatest(sessions.last_step_at, excluded.last_step_at),
   task_id = coalesce(sessions.task_id, excluded.task_id),
   client = coalesce(sessions.client, excluded.client)
RETURNING id, tenant_id, external_id"""
# Each lookup probes a key index once per step or session, so its cost does not grow with the
# sessions' length (`bench/write_path.py --turns 100 --statements`). The probe is the plan's only
# choice, whatever the server's version and statistics: a LATERAL subquery with LIMIT (or a scalar
# one) is run once per outer row with that row's keys, never flattened into a join the planner may
# hash over a scan of the partition (PostgreSQL 18 did that for `JOIN steps ... = ANY(...)` on a day
# partition without statistics). A stored step is asked for by its id alone (ids are unique): with
# `session_id = v.sid` beside it, PostgreSQL 15 probed the (session_id, seq) index and filtered every
# step of the session. The session bounds (internal ids sort alike in Python and PostgreSQL:
# proxy.store.partitions) prune the plan to the batch's day partitions.
STORED_STEPS = """
SELECT v.id FROM unnest(CAST(:ids AS text[])) AS v(id)
 CROSS JOIN LATERAL (SELECT 1 FROM steps s WHERE s.id = v.id AND s.session_id BETWEEN :lo AND :hi
                      LIMIT 1) AS stored"""
LAST_SEQ = """
SELECT v.sid, coalesce((SELECT max(seq) FROM steps
                          WHERE session_id = v.sid AND session_id BETWEEN :lo AND :hi), 0)
  FROM unnest(CAST(:sids AS text[])) AS v(sid)"""
# The `steps` columns the writer fills: the session's place (id, tenant, seq) and the record's fields.
STEP_COLUMNS = ("id", "session_id", "tenant_id", "seq",
                *(f.name for f in fields(StepRecord) if f.name != "id" and f.name not in NOT_COLUMNS))


STEP_ARRAYS = frozenset({"message_hashes", "prompt_token_ids", "output_token_ids", "output_logprobs", "output_mask",
                         "memory_facts"})


def _int4(value: int | None) -> int | None:
    """An `integer` column's value, checked: psycopg's binary dumper keeps the low 32 bits of a larger
    int (2**40 would be stored as 0), where PostgreSQL refuses it in text."""
    if value is None or -(2**31) <= value < 2**31:
        return value
    raise psycopg.errors.NumericValueOutOfRange(f"integer out of range: {value}")


def _text(value: object) -> str | None:
    """A text column's value from the engine's JSON: text COPY stored a number as its digits, the
    binary dumper would refuse it."""
    return value if value is None or type(value) is str else str(value)


def _step_row(r: StepRecord, sid: str, seq: int) -> tuple:
    """One `steps` row for binary COPY, in STEP_COLUMNS' order (STEP_ARRAYS prebuilt): the shared fields
    (atdp_schema.record.StepFields) first, then StepRecord's own. tests/unit/test_step_record.py holds
    the order to the columns."""
    return (
        r.id, sid, r.session.tenant_id, _int4(seq),
        # StepFields
        r.api, r.status, r.started_at, r.parent_step_id, r.upstream, _text(r.model), _text(r.model_version),
        _int4(r.history_len), r.transcript_hash, r.prompt_path, _text(r.finish_reason), r.ttft_ms, r.total_ms,
        _int4(r.prompt_tokens), _int4(r.completion_tokens), r.cost, r.replay_of, r.harness_version, r.memory_version,
        None if r.memory_facts is None else binary_texts(r.memory_facts),
        # StepRecord
        jsonb(pg_safe(r.error) if r.error and _has_nul(r.error) else r.error), r.system_hash, r.tools_hash,
        binary_texts(r.message_hashes), jsonb(pg_safe(r.params) if _has_nul(r.params) else r.params), r.output_hash,
        r.token_source, _int4(r.prompt_prefix_len), binary_int4s(r.prompt_token_ids), binary_int4s(r.output_token_ids),
        binary_float4s(r.output_logprobs), jsonb(r.output_versions),
        None if r.output_mask is None else binary_int4s(r.output_mask), jsonb(r.redaction), r.eligibility,
        r.eligibility_reason, r.visibility, r.retention_until,
    )


def needed_contents(kept: list[StepRecord], records: list[StepRecord]) -> dict[tuple[str, str], ContentRow]:
    """(tenant, hash) -> row: the content rows the batch carries that its `kept` steps need. Their own,
    and a row another step of the batch carried that a kept step or kept row refers to: the preparer
    gives a long text the batch shares (proxy.store.texts) to the first step that has it."""
    carried: dict[tuple[str, str], ContentRow] = {}
    for r in records:
        for c in r.contents:
            carried.setdefault((r.session.tenant_id, c.hash), c)
    if len(kept) == len(records):
        return carried
    need = [(r.session.tenant_id, h) for r in kept for h in (
        r.system_hash, r.tools_hash, r.output_hash, *r.message_hashes, *(tr.result_hash for tr in r.tool_results),
        *(c.hash for c in r.contents)) if h]
    out: dict[tuple[str, str], ContentRow] = {}
    while need:
        key = need.pop()
        row = carried.get(key)
        if row is None or key in out:
            continue
        out[key] = row
        if row.kind in ENCODED_KINDS and row.encoded:  # an output refers to its native message, it to texts
            need.extend((key[0], h) for h in refs(row.body))
    return out


def write_steps(s: Session, records: list[StepRecord], new_session_id, *,
                seen: Mapping[str, int | None] | None = None,
                on_stale: Literal["raise", "quarantine"] = "quarantine") -> int:
    """Insert a batch of step records (idempotent by step id). Returns how many were new.

    A handful of statements per batch, whatever its size: contents, sessions (upsert + lock),
    current max seq per session, steps, tool calls, tool-result links. `new_session_id` mints the
    internal id of a session seen for the first time. `seq` continues each session's numbering in
    the order the records are given. `seen`: per tenant, the forget count the preparer's cache
    reflected when it prepared the batch (proxy.store.forgets); a tenant whose count has moved since,
    or is unknown (None, or no `seen`: a spooled record), has its references checked (`on_stale`).
    """
    if not records:
        return 0
    tenants = sorted({r.session.tenant_id for r in records})
    # Before anything is read: a forget of these tenants is wholly before or wholly after this write.
    lock_tenants(s, tenants, shared=True)
    forgets = dict(s.execute(text(TENANTS), {"ids": text_array(tenants)}).all())

    # Steps of forgotten sessions are dropped first, and their contents with them: a late one
    # (spooled, re-sent) must not bring a forgotten text back as a row nothing refers to.
    kept = not_forgotten(s, records)
    if not kept:
        return 0
    needed = needed_contents(kept, records)
    if moved := [tn for tn in tenants if seen is None or seen.get(tn) is None or seen[tn] != forgets.get(tn, 0)]:
        check_references(s, kept, needed, moved, on_stale)

    # Contents (deduplicated across the batch; rows already stored are left alone).
    ordered = [(tenant, h, c.kind, _json(escape(c.body) if c.kind in ENCODED_KINDS and not c.encoded else c.body),
                c.size, json_text(c.redaction)) for (tenant, h), c in sorted(needed.items())]
    start = 0
    while start < len(ordered):  # a statement per CONTENT_CHUNK_CHARS of bodies (256 requests of 32 MB fit a batch)
        end, chars = start + 1, len(ordered[start][3])
        while end < len(ordered) and chars + len(ordered[end][3]) <= CONTENT_CHUNK_CHARS:
            chars += len(ordered[end][3])
            end += 1
        cols = list(zip(*ordered[start:end], strict=True))
        s.execute(text(CONTENT_INSERT), {
            "tenant": text_array(cols[0]), "hash": text_array(cols[1]), "kind": text_array(cols[2]),
            "body": text_array(cols[3]), "size": int_array(cols[4]), "redaction": text_array(cols[5])})
        start = end

    # Sessions: one upsert for the batch; the row locks serialise seq assignment across writers.
    first: dict[tuple[str, str], StepRecord] = {}
    last_at: dict[tuple[str, str], datetime] = {}
    for r in kept:
        key = (r.session.tenant_id, r.session.external_id)
        first.setdefault(key, r)
        last_at[key] = max(last_at.get(key, r.started_at), r.started_at)
    # A fixed-shape statement over arrays (compiled and prepared once), not a many-row VALUES that
    # SQLAlchemy compiles afresh for each batch size (a fifth of the writer's CPU went there).
    keys = sorted(first)
    rows = [(new_session_id(), k[0], k[1], first[k].session.client, _json(first[k].session.client_info),
             first[k].session.task_id, _json(first[k].session.labels), first[k].started_at, last_at[k],
             first[k].session.replay_of) for k in keys]
    cols = list(zip(*rows, strict=True))
    # Arrays built here (copy.text_array, timestamp_array), not lists: psycopg dumps a list element by
    # element in Python, about 15 us per session here.
    params = dict(zip(("id", "tenant", "ext", "client", "info", "task", "labels", "replay_of"),
                      map(text_array, cols[:7] + cols[9:]), strict=True))
    params["started"], params["last"] = timestamp_array(cols[7]), timestamp_array(cols[8])
    # The upsert locks every row it returns (inserted, or updated on conflict) until commit: a
    # concurrent writer's batch of the same session waits here, so seq numbers cannot collide.
    sid_of = {(tenant, ext): sid for sid, tenant, ext in s.execute(text(SESSION_UPSERT), params)}
    sids = sorted(sid_of.values())
    # One array parameter each, not a rendered IN list of the batch's sessions (a bind per session).
    sid_array = text_array(sids)
    # Steps already stored (a re-sent batch): by id within the batch's session bounds, so only those
    # sessions' partitions are searched (by step id alone, every partition's key index would be).
    existing = set(s.scalars(text(STORED_STEPS), {"lo": sids[0], "hi": sids[-1], "ids": text_array([r.id for r in kept])}))
    fresh = [r for r in kept if r.id not in existing]
    if not fresh:
        return 0
    next_seq = dict(s.execute(text(LAST_SEQ), {"sids": sid_array, "lo": sids[0], "hi": sids[-1]}).all())

    step_rows, call_rows, links = [], {}, {}
    for r in fresh:
        sid = sid_of[(r.session.tenant_id, r.session.external_id)]
        next_seq[sid] += 1
        step_rows.append((r, sid, next_seq[sid]))
        # A tool name is whatever the model generated: cut to the column (256) rather than have the
        # database refuse the whole step (a dead letter for a call the client got 200 for). A call id
        # the model repeated within one step is kept once (the first), as before.
        for tc in r.tool_calls:
            call_rows.setdefault((r.id, tc.call_id), (r.id, tc.call_id, sid, r.session.tenant_id,
                                                      pg_safe(tc.name)[:256], jsonb(pg_safe(tc.arguments))))
        for tr in r.tool_results:  # the first result for a call links it (as the per-row updates did)
            links.setdefault((sid, tr.call_id), (sid, tr.call_id, r.id, tr.result_hash, tr.is_error))
    # Rows are built inside the COPY: a value the database would refuse fails as its error would.
    copy_rows_binary(s, "steps", STEP_COLUMNS, (_step_row(*row) for row in step_rows), STEP_ARRAYS)
    if call_rows:
        copy_rows(s, "tool_calls", CALL_COLUMNS, call_rows.values())
    if links:
        # Link each result to the open call that asked for it (same session, that call id): one statement.
        cols = list(zip(*links.values(), strict=True))
        s.execute(text(LINK_UPDATE), {"sid": text_array(cols[0]), "cid": text_array(cols[1]),
                                      "step": text_array(cols[2]), "hash": text_array(cols[3]),
                                      "err": bool_array(cols[4])})
    return len(fresh)


@dataclass
class SealedResponse:
    """A `/v1/responses` conversation, sealed (encrypted) by the Responses door, on its way to
    `stored_responses`. It travels the steps' durable path (writer, spool) so an outage of the
    database does not drop it; the spool holds it sealed, as the table does."""

    id: str
    tenant_id: str
    step_id: str | None
    sealed: bytes
    expires_at: datetime | None

    KIND = "stored_response"  # the spool's marker: step records have no "kind"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "id": self.id, "tenant_id": self.tenant_id, "step_id": self.step_id,
                "sealed": base64.b64encode(self.sealed).decode(), "expires_at": self.expires_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SealedResponse:
        expires = data.get("expires_at")
        return cls(id=data["id"], tenant_id=data["tenant_id"], step_id=data.get("step_id"),
                   sealed=base64.b64decode(data["sealed"]),
                   expires_at=datetime.fromisoformat(expires) if isinstance(expires, str) else expires)


def record_from_json(data: dict[str, Any]) -> StepRecord | SealedResponse:
    """A spooled record back: a sealed response (marked) or a step record."""
    return SealedResponse.from_json(data) if data.get("kind") == SealedResponse.KIND else StepRecord.from_json(data)


def write_sealed_responses(s: Session, rows: list[SealedResponse]) -> int:
    """Insert sealed responses; idempotent by id (a re-sent or replayed one is ignored)."""
    if not rows:
        return 0
    s.execute(insert(t.StoredResponse).values([
        {"id": r.id, "tenant_id": r.tenant_id, "step_id": r.step_id, "sealed": r.sealed, "expires_at": r.expires_at}
        for r in rows]).on_conflict_do_nothing(index_elements=["id"]))
    return len(rows)
