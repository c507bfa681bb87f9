"""Forget and retention: deleting a session's, a tenant's, or expired data, with an audit row.

Deletion is real (rows go, not flags): a forgotten session's steps (with their token ids), tool calls,
feedback, stored responses and lineage rows are deleted, then every content row of the tenant that no
remaining step or tool call references. Contents are per tenant, so another tenant's identical text is
never touched. `version_lineage` rows of forgotten steps go too; the audit row keeps, per version, how
many of its training steps were forgotten, so "version X trained on N steps" stays answerable. The audit
row carries counts and ids, never content.

Each function runs in the caller's transaction and returns a `Forgotten` report; callers that hold a
`Recorder` should call `recorder.forget(tenant, step_ids=..., content_hashes=..., sessions=...)`
afterwards so the writer's caches do not believe deleted contents are still stored and its spool
drops the sessions' pending records. Each function also announces what it deleted to every proxy on
the database (`announce`: notes delivered when the transaction commits), so a forget run on one proxy,
or by `atdp forget`, reaches every proxy's caches, spool and dead letters (proxy.control.admin).
Forgetting a session or a tenant leaves a tombstone: the
writer drops any step of it that started before the forget, whenever it arrives, so a forget is
final (retention does not: it removes old sessions, whose late steps cannot exist).
Each forget holds its tenants' write locks from its start to its commit, and one that deleted contents
adds one to the tenant's forget count (proxy.store.forgets): no write of the tenant overlaps it, and a
writer whose cache had not heard of it checks what its batch refers to.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import and_, delete, func, or_, select, text, true
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from proxy.store import partitions
from proxy.store import tables as t
from proxy.store.db import db_error_reason
from proxy.store.forgets import bump, lock_tenants
from proxy.store.layers import forget_facts
from proxy.store.notes import NOTIFY, split
from proxy.store.read import find_session
from proxy.store.texts import ENCODED_KINDS, all_refs

log = logging.getLogger("atdp.governance")


@dataclass
class Forgotten:
    tenant: str
    sessions: int = 0
    steps: int = 0
    tokens: int = 0
    tool_calls: int = 0
    feedback: int = 0
    stored_responses: int = 0
    contents: int = 0
    facts: int = 0  # memory's facts the forgotten sessions supplied (proxy.store.layers)
    lineage: dict[str, int] = field(default_factory=dict)  # version id -> forgotten training steps
    step_ids: list[str] = field(default_factory=list)  # for cache invalidation; not audited
    content_hashes: list[str] = field(default_factory=list)  # the deleted contents' (caches); not audited
    external_ids: list[str] = field(default_factory=list)  # forgotten sessions' public ids (spool purge)
    partitions: list[str] = field(default_factory=list)  # days whose partitions retention dropped
    forgets: int | None = None  # the tenant's forget count after this one, when it deleted contents

    def count_forget(self, s: Session, *, whole_tenant: bool = False) -> None:
        """Count this forget (proxy.store.forgets) when it deleted contents writers may believe stored."""
        if whole_tenant or self.content_hashes:
            self.forgets = bump(s, self.tenant)

    def counts(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "steps": self.steps, "tokens": self.tokens,
                "tool_calls": self.tool_calls, "feedback": self.feedback,
                "stored_responses": self.stored_responses, "contents": self.contents, "facts": self.facts,
                "lineage": self.lineage,
                "partitions": self.partitions}


def _forget_sessions(s: Session, tenant: str, session_ids: list[str], out: Forgotten) -> None:
    if not session_ids:
        return
    steps = s.execute(
        select(t.Step.id, t.Step.system_hash, t.Step.tools_hash, t.Step.output_hash, t.Step.message_hashes,
               func.cardinality(t.Step.prompt_token_ids) + func.cardinality(t.Step.output_token_ids))
        .where(t.Step.session_id.in_(session_ids))
    ).all()
    step_ids = [r[0] for r in steps]
    hashes: set[str] = set()
    for _, system_hash, tools_hash, output_hash, message_hashes, n_tokens in steps:
        hashes.update(h for h in (system_hash, tools_hash, output_hash, *(message_hashes or [])) if h)
        out.tokens += n_tokens or 0
    hashes.update(h for h in s.scalars(
        select(t.ToolCall.result_hash).where(t.ToolCall.session_id.in_(session_ids), t.ToolCall.result_hash.is_not(None))
    ))
    if step_ids:
        lineage = s.execute(
            select(t.VersionLineage.version_id, func.count()).where(t.VersionLineage.step_id.in_(step_ids))
            .group_by(t.VersionLineage.version_id)
        ).all()
        for version_id, n in lineage:
            out.lineage[version_id] = out.lineage.get(version_id, 0) + n
        s.execute(delete(t.VersionLineage).where(t.VersionLineage.step_id.in_(step_ids)))
        # Continuation keys other proxies would link new calls with (proxy.store.links).
        s.execute(delete(t.ContinuationLink).where(t.ContinuationLink.step_id.in_(step_ids)))
    out.feedback += s.execute(delete(t.Feedback).where(t.Feedback.session_id.in_(session_ids))).rowcount
    out.tool_calls += s.execute(delete(t.ToolCall).where(t.ToolCall.session_id.in_(session_ids))).rowcount
    out.stored_responses += s.execute(
        delete(t.StoredResponse).where(
            t.StoredResponse.tenant_id == tenant,
            or_(t.StoredResponse.session_id.in_(session_ids), t.StoredResponse.step_id.in_(step_ids or [""])),
        )
    ).rowcount
    out.steps += s.execute(delete(t.Step).where(t.Step.session_id.in_(session_ids))).rowcount
    out.sessions += s.execute(delete(t.Session).where(t.Session.id.in_(session_ids))).rowcount
    out.facts += forget_facts(s, tenant, session_ids)
    out.contents += _delete_orphan_contents(s, tenant, sorted(hashes), out.content_hashes)[0]
    out.step_ids.extend(step_ids)


# Those of :hashes no remaining step or tool call of the tenant refers to, deleted. One pass over the
# tenant's steps finds which candidates are still used (a hashed `= ANY` per row); a NOT EXISTS per
# candidate, with its OR over four columns, scanned the tenant's steps once per candidate instead
# (`bench/retention.py`: 53 s of PostgreSQL CPU for 24,000 candidates against 12,000 steps).
ORPHANS = (
    "WITH used AS ("
    "  SELECT h FROM steps st CROSS JOIN LATERAL "
    "         unnest(ARRAY[st.system_hash, st.tools_hash, st.output_hash] || st.message_hashes) AS h "
    "   WHERE st.tenant_id = :tenant AND h = ANY(CAST(:hashes AS text[])) "
    "  UNION SELECT tc.result_hash FROM tool_calls tc "
    "   WHERE tc.tenant_id = :tenant AND tc.result_hash = ANY(CAST(:hashes AS text[]))) "
    "DELETE FROM contents c WHERE c.tenant_id = :tenant AND c.hash = ANY(CAST(:hashes AS text[])) "
    "AND c.hash NOT IN (SELECT h FROM used)"
)
# The long texts (proxy.store.texts) that the tenant's remaining message and output bodies refer to,
# among :hashes: one pass over the bodies that hold a reference at all.
REFERRED = (
    "SELECT DISTINCT substr(v #>> '{}', 3) FROM contents c "
    "CROSS JOIN LATERAL jsonb_path_query(c.body, 'strict $.** ? (@ starts with $m)', "
    "                                    jsonb_build_object('m', chr(57344) || '@')) AS v "
    "WHERE c.tenant_id = :tenant AND c.kind IN ('message', 'output') AND strpos(c.body::text, chr(57344) || '@') > 0"
)


def _delete_orphan_contents(s: Session, tenant: str, hashes: list[str], deleted: list[str] | None = None,
                            without: list[tuple[str, str]] = ()) -> tuple[int, list[str]]:
    """Delete those of `hashes` no remaining step or tool call of the tenant references, then the long
    texts the deleted bodies referred to that nothing refers to any more. Returns (rows deleted, the
    text hashes checked); `deleted` (when given) collects the deleted rows' hashes. `without`: ranges
    of session ids whose steps and tool calls count as gone (days about to be dropped)."""
    sql, params = ORPHANS, {}
    for i, (lo, hi) in enumerate(without):
        sql = sql.replace(" AND h = ANY", f" AND NOT (st.session_id >= :lo{i} AND st.session_id < :hi{i}) AND h = ANY", 1)
        sql = sql.replace(" AND tc.result_hash = ANY",
                          f" AND NOT (tc.session_id >= :lo{i} AND tc.session_id < :hi{i}) AND tc.result_hash = ANY", 1)
        params |= {f"lo{i}": lo, f"hi{i}": hi}
    n, checked, batch, live = 0, set(), hashes, None
    while batch:  # an output refers to its native message, which refers to texts: two rounds at most
        refs: set[str] = set()
        for i in range(0, len(batch), 10_000):
            gone = s.execute(text(sql + " RETURNING c.kind, c.body, c.hash"),
                             {"tenant": tenant, "hashes": batch[i : i + 10_000], **params}).all()
            n += len(gone)
            if deleted is not None:
                deleted.extend(h for _, _, h in gone)
            refs |= all_refs(body for kind, body, _ in gone if kind in ENCODED_KINDS)
        refs -= checked
        checked |= refs
        if refs:
            live = set(s.scalars(text(REFERRED), {"tenant": tenant}))
        batch = sorted(refs - (live or set()))
    return n, sorted(checked)


def tombstone(s: Session, tenant: str, external_id: str | None) -> None:
    """Mark a session (None: the whole tenant) forgotten: the writer drops its steps that started
    before now, whenever they arrive (proxy.store.write.not_forgotten)."""
    s.add(t.Tombstone(tenant_id=tenant, external_id=external_id))


def _audit(s: Session, actor: str, tenant: str, action: str, target: str | None, details: dict) -> None:
    s.add(t.AuditEvent(actor=actor, tenant_id=tenant, action=action, target=target, details=details))


def forget_session(s: Session, session_id: str, *, tenant: str | None, actor: str,
                   reason: str | None = None, origin: str = "") -> Forgotten | None:
    """Forget one session (public or internal id); None when there is no such session."""
    row = find_session(s, session_id, tenant)
    if row is None:
        return None
    out = Forgotten(tenant=row.tenant_id)
    lock_tenants(s, [row.tenant_id], shared=False)  # no write of the tenant overlaps the forget
    s.execute(select(t.Session.id).where(t.Session.id == row.id).with_for_update())
    _forget_sessions(s, row.tenant_id, [row.id], out)
    tombstone(s, row.tenant_id, row.external_id)
    out.count_forget(s)
    out.external_ids.append(row.external_id)
    details = {**out.counts(), "session_id": row.id}
    if reason:
        details["reason"] = reason
    _audit(s, actor, row.tenant_id, "forget.session", row.external_id, details)
    announce(s, out, origin=origin)
    return out


def forget_tenant(s: Session, tenant: str, *, actor: str, reason: str | None = None, origin: str = "") -> Forgotten:
    """Forget all of a tenant's recorded data. Its keys and policy stay (they are configuration);
    every remaining content row of the tenant goes as well."""
    out = Forgotten(tenant=tenant)
    lock_tenants(s, [tenant], shared=False)
    tombstone(s, tenant, None)
    session_ids = list(s.scalars(select(t.Session.id).where(t.Session.tenant_id == tenant)))
    for i in range(0, len(session_ids), 500):
        _forget_sessions(s, tenant, session_ids[i : i + 500], out)
    # Steps are always in a session; anything left of the tenant (feedback without a session cannot
    # exist, contents can) goes here.
    out.contents += s.execute(delete(t.Content).where(t.Content.tenant_id == tenant)).rowcount
    out.stored_responses += s.execute(delete(t.StoredResponse).where(t.StoredResponse.tenant_id == tenant)).rowcount
    out.facts += forget_facts(s, tenant, None)  # also those an operator wrote
    out.count_forget(s, whole_tenant=True)
    details = out.counts()
    if reason:
        details["reason"] = reason
    _audit(s, actor, tenant, "forget.tenant", tenant, details)
    announce(s, out, whole_tenant=True, origin=origin)
    return out


# What a day's sessions hold, per tenant, read before its partitions are dropped (the arrays' lengths
# are read from the rows: the audit counts stored token ids, as a forget by row does).
_IN_DAY = "session_id >= :lo AND session_id < :hi"
# Memory's facts that a session of the day supplied (a memory's facts are few: read whole).
_DAY_FACTS = ("DELETE FROM memory_facts f WHERE EXISTS (SELECT 1 FROM jsonb_array_elements_text("
              "CASE WHEN jsonb_typeof(f.source -> 'sessions') = 'array' THEN f.source -> 'sessions' ELSE '[]' END) x "
              "WHERE x >= :lo AND x < :hi)")
_DAY_STEPS = ("SELECT tenant_id, count(*), coalesce(sum(cardinality(prompt_token_ids) + cardinality(output_token_ids)), 0) "
              f"FROM steps WHERE {_IN_DAY} GROUP BY tenant_id")
_DAY_HASHES = (
    "SELECT DISTINCT tenant_id, h FROM steps CROSS JOIN LATERAL "
    f"unnest(ARRAY[system_hash, tools_hash, output_hash] || message_hashes) AS h WHERE {_IN_DAY} AND h IS NOT NULL "
    f"UNION SELECT DISTINCT tenant_id, result_hash FROM tool_calls WHERE {_IN_DAY} AND result_hash IS NOT NULL")


def _counted(s: Session, sql: str, day: dict[str, str]) -> list[tuple[str, int]]:
    """(tenant, rows) of a statement that deletes rows of a day's sessions."""
    return s.execute(text(f"WITH d AS ({sql} RETURNING tenant_id) SELECT tenant_id, count(*) FROM d GROUP BY tenant_id"),
                     day).all()


def due_days(s: Session, *, policy_for, now: datetime) -> list[tuple[partitions.DayPartition, list[str]]]:
    """The days retention drops whole, with their tenants: a day goes once every tenant with a session
    begun that day has a `retention_days` and the day's start is that many days past, so its sessions
    go between zero and one day before their own deadline (`started_at + retention_days`), never
    after. A past day that holds no session goes once a day has passed (ids are minted at write: no
    session can join it)."""
    out = []
    for part in partitions.day_partitions(s):
        if part.end > now or part.tables != partitions.TABLES:
            continue  # a day one table lacks (its rows in the default partition) goes by row
        lo, hi = partitions.id_range(part.day)
        tenants = list(s.scalars(text("SELECT DISTINCT tenant_id FROM sessions WHERE id >= :lo AND id < :hi"),
                                 {"lo": lo, "hi": hi}))
        if not tenants and part.end + timedelta(days=1) > now:
            continue
        if all((days := policy_for(s, tenant).retention_days) and part.start + timedelta(days=days) <= now
               for tenant in tenants):
            out.append((part, tenants))
    return out


def _forget_days(s: Session, days: list[tuple[partitions.DayPartition, list[str]]], *, now: datetime,
                 quiet_s: float, by_tenant: dict[str, Forgotten]) -> None:
    """Forget whole days: everything of their sessions outside `steps` and `tool_calls` by row, those
    two by dropping the days' partitions, last (the drop holds `steps`' lock until the transaction
    commits: nothing slow may follow it).

    Sessions of the days active within `quiet_s` (the continuation window: a proxy's memory may still
    link a new call to them) are forgotten by row first, so every cache hears of their step ids.
    Contents only the days used are deleted as if the days were already gone."""
    ranges = [partitions.id_range(part.day) for part, _ in days]
    hashes: dict[str, set[str]] = {}
    for (part, tenants), (lo, hi) in zip(days, ranges, strict=True):
        day = {"lo": lo, "hi": hi}
        outs = {tenant: by_tenant.setdefault(tenant, Forgotten(tenant=tenant)) for tenant in tenants}
        active = s.execute(text("SELECT tenant_id, id FROM sessions WHERE id >= :lo AND id < :hi "
                                "AND last_step_at > :since ORDER BY id"),
                           {**day, "since": now - timedelta(seconds=quiet_s)}).all()
        for tenant in sorted({tenant for tenant, _ in active}):
            sids = [sid for tn, sid in active if tn == tenant]
            for i in range(0, len(sids), 500):
                _forget_sessions(s, tenant, sids[i : i + 500], outs[tenant])
        for tenant, n, tokens in s.execute(text(_DAY_STEPS), day):
            outs[tenant].steps += n
            outs[tenant].tokens += tokens
        for tenant, h in s.execute(text(_DAY_HASHES), day):
            hashes.setdefault(tenant, set()).add(h)
        for tenant, n in s.execute(text(f"SELECT tenant_id, count(*) FROM tool_calls WHERE {_IN_DAY} GROUP BY 1"), day):
            outs[tenant].tool_calls += n
        for tenant, version_id, n in s.execute(text(
            "SELECT se.tenant_id, l.version_id, count(*) FROM version_lineage l JOIN sessions se ON se.id = l.session_id "
            f"WHERE l.{_IN_DAY} GROUP BY 1, 2"), day):
            outs[tenant].lineage[version_id] = outs[tenant].lineage.get(version_id, 0) + n
        s.execute(text(f"DELETE FROM version_lineage WHERE {_IN_DAY}"), day)
        s.execute(text(f"DELETE FROM continuation_links WHERE step_id IN (SELECT id FROM steps WHERE {_IN_DAY})"), day)
        for tenant, n in _counted(s, f"DELETE FROM feedback WHERE {_IN_DAY}", day):
            outs[tenant].feedback += n
        for tenant, n in _counted(s, f"DELETE FROM stored_responses WHERE {_IN_DAY}", day):
            outs[tenant].stored_responses += n
        for tenant, n in _counted(s, "DELETE FROM sessions WHERE id >= :lo AND id < :hi", day):
            outs[tenant].sessions += n
        for tenant, n in _counted(s, _DAY_FACTS, day):
            outs.setdefault(tenant, by_tenant.setdefault(tenant, Forgotten(tenant=tenant))).facts += n
        for out in outs.values():
            out.partitions.append(part.day.isoformat())
    for tenant, found in sorted(hashes.items()):
        # The caches hear of the deleted contents only: told of every candidate, they would forget
        # texts live sessions still use (the token guard would then drop those sessions' token ids).
        out = by_tenant[tenant]
        out.contents += _delete_orphan_contents(s, tenant, sorted(found), out.content_hashes, without=ranges)[0]
    for part, _ in days:
        partitions.drop(s, part)


def run_retention(s: Session, *, policy_for, now: datetime | None = None, actor: str = "system",
                  limit: int = 10_000, quiet_s: float = 24 * 3600.0, origin: str = "") -> list[Forgotten]:
    """Forget every session holding a step past its retention deadline.

    A step's deadline is its `retention_until` (set at write from the policy then in force) or, when the
    tenant's policy has since shortened retention, `started_at + retention_days`. A whole session goes:
    its later steps replay the earlier ones' context (messages and token prefix), so keeping them would
    keep the expired text. Whole days of sessions go by dropping their partitions (`due_days`,
    `_forget_days`), the rest row by row. Also drops expired stored responses. One audit row per
    tenant touched. A day whose partitions cannot be locked within 5 s (a long reader) is left, with
    all it holds, for the next run.
    """
    now = now or datetime.now(UTC)
    days = due_days(s, policy_for=policy_for, now=now) if partitions.is_partitioned(s) else []
    outside = and_(true(), *(or_(t.Step.session_id < lo, t.Step.session_id >= hi)
                     for lo, hi in (partitions.id_range(part.day) for part, _ in days)))
    due: dict[str, list[str]] = {}
    expired = (
        select(t.Step.tenant_id, t.Step.session_id)
        .where(t.Step.retention_until < now, outside)
        .distinct()
        .limit(limit)
    )
    for tenant, sid in s.execute(expired):
        due.setdefault(tenant, []).append(sid)
    for tenant in s.scalars(select(t.Tenant.id)):
        days_kept = policy_for(s, tenant).retention_days
        if not days_kept:
            continue
        cutoff = now - timedelta(days=days_kept)
        q = (select(t.Step.session_id).where(t.Step.tenant_id == tenant, t.Step.started_at < cutoff, outside)
             .distinct().limit(limit))
        for sid in s.scalars(q):
            if sid not in due.get(tenant, ()):
                due.setdefault(tenant, []).append(sid)
    # Every tenant the run deletes from, locked before it deletes anything, in one order.
    lock_tenants(s, [*due, *(tenant for _, tenants in days for tenant in tenants)], shared=False)
    by_tenant: dict[str, Forgotten] = {}
    for tenant, sids in sorted(due.items()):
        out = by_tenant.setdefault(tenant, Forgotten(tenant=tenant))
        for i in range(0, len(sids), 500):
            _forget_sessions(s, tenant, sids[i : i + 500], out)
    responses = Counter(s.scalars(
        delete(t.StoredResponse).where(t.StoredResponse.expires_at < now).returning(t.StoredResponse.tenant_id)
    ))
    for tenant, n in responses.items():
        by_tenant.setdefault(tenant, Forgotten(tenant=tenant)).stored_responses += n
    if days:
        staged: dict[str, Forgotten] = {}
        try:
            with s.begin_nested():
                _forget_days(s, days, now=now, quiet_s=quiet_s, by_tenant=staged)
        except OperationalError as e:
            log.warning("retention left %d due day(s) for the next run (%s)", len(days), db_error_reason(e))
        else:
            for tenant, got in staged.items():
                _merge(by_tenant.setdefault(tenant, Forgotten(tenant=tenant)), got)
            log.info("retention dropped the partitions of %s", ", ".join(part.day.isoformat() for part, _ in days))
    for out in by_tenant.values():
        out.count_forget(s)
        _audit(s, actor, out.tenant, "retention.forget", out.tenant, {**out.counts(), "now": now.isoformat()})
        announce(s, out, origin=origin)
    return list(by_tenant.values())


def announcement(out: Forgotten, *, whole_tenant: bool = False, sessions: list[str] = (), origin: str = "") -> list[str]:
    """The notes that tell every proxy what `out` deleted (proxy.control.admin.follow_forgets): the
    step ids (continuation keys, token caches), the deleted contents' hashes (a writer that still
    believed them stored would write steps referring to rows that are gone; a whole tenant's are
    all of them), the sessions' public ids (spool, dead letters) and, in a last note of its own, the
    tenant's forget count after it (proxy.store.forgets). `origin`: the announcing
    proxy's bus id, which skips its own notes; '' (the command line) is followed by every proxy."""
    base = {"op": "forget", "from": origin, "tenant": out.tenant, "whole": whole_tenant}
    notes = split(base, {"sessions": sorted({*out.external_ids, *sessions}), "steps": out.step_ids,
                         "contents": [] if whole_tenant else out.content_hashes})
    if out.forgets is not None:  # last: a follower has every deleted hash by the time it counts the forget
        notes.append(orjson.dumps({**base, "forgets": out.forgets, "sessions": [], "steps": [], "contents": []}).decode())
    return notes


def announce(s: Session, out: Forgotten, *, whole_tenant: bool = False, sessions: list[str] = (),
             origin: str = "") -> None:
    """Queue `announcement(out)` in the forget's own transaction: delivered if, and when, it commits."""
    if not (whole_tenant or out.step_ids or out.content_hashes or out.external_ids or sessions):
        return  # nothing any proxy holds (retention that only expired stored responses)
    for payload in announcement(out, whole_tenant=whole_tenant, sessions=sessions, origin=origin):
        s.execute(NOTIFY, {"payload": payload})


def _merge(into: Forgotten, got: Forgotten) -> None:
    for name in ("sessions", "steps", "tokens", "tool_calls", "feedback", "stored_responses", "contents"):
        setattr(into, name, getattr(into, name) + getattr(got, name))
    for version_id, n in got.lineage.items():
        into.lineage[version_id] = into.lineage.get(version_id, 0) + n
    into.step_ids.extend(got.step_ids)
    into.content_hashes.extend(got.content_hashes)
    into.external_ids.extend(got.external_ids)
    into.partitions.extend(got.partitions)
