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
drops the sessions' pending records. Forgetting a session or a tenant leaves a tombstone: the
writer drops any step of it that started before the forget, whenever it arrives, so a forget is
final (retention does not: it removes old sessions, whose late steps cannot exist).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, or_, select, text
from sqlalchemy.orm import Session

from proxy.store import tables as t
from proxy.store.read import find_session
from proxy.store.texts import ENCODED_KINDS, all_refs


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
    lineage: dict[str, int] = field(default_factory=dict)  # version id -> forgotten training steps
    step_ids: list[str] = field(default_factory=list)  # for cache invalidation; not audited
    content_hashes: list[str] = field(default_factory=list)  # candidates checked; not audited
    external_ids: list[str] = field(default_factory=list)  # forgotten sessions' public ids (spool purge)

    def counts(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "steps": self.steps, "tokens": self.tokens,
                "tool_calls": self.tool_calls, "feedback": self.feedback,
                "stored_responses": self.stored_responses, "contents": self.contents, "lineage": self.lineage}


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
    deleted, texts = _delete_orphan_contents(s, tenant, sorted(hashes))
    out.contents += deleted
    out.step_ids.extend(step_ids)
    out.content_hashes.extend(sorted(hashes) + texts)


ORPHANS = (
    "DELETE FROM contents c WHERE c.tenant_id = :tenant AND c.hash = ANY(:hashes) "
    "AND NOT EXISTS (SELECT 1 FROM steps st WHERE st.tenant_id = :tenant AND ("
    "  st.system_hash = c.hash OR st.tools_hash = c.hash OR st.output_hash = c.hash"
    "  OR c.hash = ANY(st.message_hashes))) "
    "AND NOT EXISTS (SELECT 1 FROM tool_calls tc WHERE tc.tenant_id = :tenant AND tc.result_hash = c.hash)"
)
# The long texts (proxy.store.texts) that the tenant's remaining message and output bodies refer to,
# among :hashes: one pass over the bodies that hold a reference at all.
REFERRED = (
    "SELECT DISTINCT substr(v #>> '{}', 3) FROM contents c "
    "CROSS JOIN LATERAL jsonb_path_query(c.body, 'strict $.** ? (@ starts with $m)', "
    "                                    jsonb_build_object('m', chr(57344) || '@')) AS v "
    "WHERE c.tenant_id = :tenant AND c.kind IN ('message', 'output') AND strpos(c.body::text, chr(57344) || '@') > 0"
)


def _delete_orphan_contents(s: Session, tenant: str, hashes: list[str]) -> tuple[int, list[str]]:
    """Delete those of `hashes` no remaining step or tool call of the tenant references, then the long
    texts the deleted bodies referred to that nothing refers to any more. Returns (rows deleted, the
    text hashes checked)."""
    n, checked, batch, live = 0, set(), hashes, None
    while batch:  # an output refers to its native message, which refers to texts: two rounds at most
        refs: set[str] = set()
        for i in range(0, len(batch), 1000):
            gone = s.execute(text(ORPHANS + " RETURNING c.kind, c.body"),
                             {"tenant": tenant, "hashes": batch[i : i + 1000]}).all()
            n += len(gone)
            refs |= all_refs(body for kind, body in gone if kind in ENCODED_KINDS)
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
                   reason: str | None = None) -> Forgotten | None:
    """Forget one session (public or internal id); None when there is no such session."""
    row = find_session(s, session_id, tenant)
    if row is None:
        return None
    out = Forgotten(tenant=row.tenant_id)
    s.execute(select(t.Session.id).where(t.Session.id == row.id).with_for_update())
    _forget_sessions(s, row.tenant_id, [row.id], out)
    tombstone(s, row.tenant_id, row.external_id)
    out.external_ids.append(row.external_id)
    details = {**out.counts(), "session_id": row.id}
    if reason:
        details["reason"] = reason
    _audit(s, actor, row.tenant_id, "forget.session", row.external_id, details)
    return out


def forget_tenant(s: Session, tenant: str, *, actor: str, reason: str | None = None) -> Forgotten:
    """Forget all of a tenant's recorded data. Its keys and policy stay (they are configuration);
    every remaining content row of the tenant goes as well."""
    out = Forgotten(tenant=tenant)
    tombstone(s, tenant, None)
    session_ids = list(s.scalars(select(t.Session.id).where(t.Session.tenant_id == tenant)))
    for i in range(0, len(session_ids), 500):
        _forget_sessions(s, tenant, session_ids[i : i + 500], out)
    # Steps are always in a session; anything left of the tenant (feedback without a session cannot
    # exist, contents can) goes here.
    out.contents += s.execute(delete(t.Content).where(t.Content.tenant_id == tenant)).rowcount
    out.stored_responses += s.execute(delete(t.StoredResponse).where(t.StoredResponse.tenant_id == tenant)).rowcount
    details = out.counts()
    if reason:
        details["reason"] = reason
    _audit(s, actor, tenant, "forget.tenant", tenant, details)
    return out


def run_retention(s: Session, *, policy_for, now: datetime | None = None, actor: str = "system",
                  limit: int = 10_000) -> list[Forgotten]:
    """Forget every session holding a step past its retention deadline.

    A step's deadline is its `retention_until` (set at write from the policy then in force) or, when the
    tenant's policy has since shortened retention, `started_at + retention_days`. A whole session goes:
    its later steps replay the earlier ones' context (messages and token prefix), so keeping them would
    keep the expired text. Also drops expired stored responses. One audit row per tenant touched.
    """
    now = now or datetime.now(UTC)
    due: dict[str, list[str]] = {}
    expired = (
        select(t.Step.tenant_id, t.Step.session_id)
        .where(t.Step.retention_until < now)
        .distinct()
        .limit(limit)
    )
    for tenant, sid in s.execute(expired):
        due.setdefault(tenant, []).append(sid)
    for tenant in s.scalars(select(t.Tenant.id)):
        days = policy_for(s, tenant).retention_days
        if not days:
            continue
        cutoff = now - timedelta(days=days)
        q = (select(t.Step.session_id).where(t.Step.tenant_id == tenant, t.Step.started_at < cutoff)
             .distinct().limit(limit))
        for sid in s.scalars(q):
            if sid not in due.get(tenant, ()):
                due.setdefault(tenant, []).append(sid)
    reports = []
    for tenant, sids in sorted(due.items()):
        out = Forgotten(tenant=tenant)
        for i in range(0, len(sids), 500):
            _forget_sessions(s, tenant, sids[i : i + 500], out)
        reports.append(out)
    responses = Counter(s.scalars(
        delete(t.StoredResponse).where(t.StoredResponse.expires_at < now).returning(t.StoredResponse.tenant_id)
    ))
    by_tenant = {r.tenant: r for r in reports}
    for tenant, n in responses.items():
        by_tenant.setdefault(tenant, Forgotten(tenant=tenant)).stored_responses += n
    for out in by_tenant.values():
        _audit(s, actor, out.tenant, "retention.forget", out.tenant, {**out.counts(), "now": now.isoformat()})
    return list(by_tenant.values())
