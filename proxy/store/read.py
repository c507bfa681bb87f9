"""Reading ATDP records: a stored session rebuilt as ATDP JSON (valid against atdp_schema)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from atdp_schema import models as m
from proxy.store import tables as t
from proxy.store.rewards import combine_rewards
from proxy.store.texts import ENCODED_KINDS, all_refs, decode
from proxy.store.tokens import rebuild_prompt_ids


def load_contents(s: Session, tenant: str, hashes: set[str]) -> dict[str, Any]:
    """Bodies by hash, as written: rows a body refers to (proxy.store.texts) read back in place."""
    rows: dict[str, tuple[str, Any]] = {}
    wanted = set(hashes)
    while wanted:  # references go at most two deep (an output's message, its texts)
        fetched = s.execute(
            select(t.Content.hash, t.Content.kind, t.Content.body)
            .where(t.Content.tenant_id == tenant, t.Content.hash.in_(wanted))
        ).all()
        rows.update((h, (kind, body)) for h, kind, body in fetched)
        wanted = all_refs(body for _, kind, body in fetched if kind in ENCODED_KINDS) - rows.keys()
    done: dict[str, Any] = {}

    def read(h: str) -> Any:
        if h not in done:
            kind, body = rows.get(h, (None, None))
            done[h] = decode(body, read) if kind in ENCODED_KINDS else body
        return done[h]

    return {h: read(h) for h in hashes if h in rows}


def _ref(h: str | None, contents: dict[str, Any]) -> m.ContentRef | None:
    return None if h is None else m.ContentRef(hash=h, content=contents.get(h))


def session_document(s: Session, session: t.Session, *, reward_combine: str = "last") -> m.Session:
    """A stored session as ATDP JSON; `reward_combine` is the tenant policy's (`Policies.policy_for`)."""
    steps = list(s.scalars(select(t.Step).where(t.Step.session_id == session.id).order_by(t.Step.seq)))
    by_id = {st.id: st for st in steps}
    prompts = rebuild_prompt_ids(by_id, fetch=lambda i, sid: t.get_step(s, i, sid))
    hashes: set[str] = set()
    for st in steps:
        hashes.update(h for h in (st.system_hash, st.tools_hash, st.output_hash) if h)
        hashes.update(st.message_hashes)
    calls = list(s.scalars(select(t.ToolCall).where(t.ToolCall.session_id == session.id)))
    hashes.update(c.result_hash for c in calls if c.result_hash)
    contents = load_contents(s, session.tenant_id, hashes)
    results_by_step: dict[str, list[m.ToolResult]] = defaultdict(list)
    for c in calls:
        if c.result_step_id:
            results_by_step[c.result_step_id].append(
                m.ToolResult(tool_call_id=c.call_id, call_step_id=c.step_id,
                             content=contents.get(c.result_hash) if c.result_hash else None,
                             is_error=bool(c.is_error))
            )
    trained: dict[str, list[str]] = defaultdict(list)
    if steps:
        for version_id, step_id in s.execute(
            select(t.VersionLineage.version_id, t.VersionLineage.step_id).where(
                t.VersionLineage.step_id.in_(list(by_id))
            )
        ):
            trained[step_id].append(version_id)
    feedback = list(s.scalars(select(t.Feedback).where(t.Feedback.session_id == session.id).order_by(t.Feedback.created_at)))
    return m.Session(
        id=session.external_id,
        tenant=session.tenant_id,
        client=session.client,
        task_id=session.task_id,
        status=session.status,
        started_at=session.started_at,
        ended_at=session.ended_at,
        labels=session.labels or {},
        reward=session_reward(feedback, reward_combine),
        replay_of=_external_id(s, session.replay_of),
        steps=[_step(st, session.external_id, contents, prompts[st.id], results_by_step.get(st.id, []), trained)
               for st in steps],
        feedback=[feedback_model(f, session.external_id) for f in feedback],
    )


def _external_id(s: Session, session_id: str | None) -> str | None:
    if session_id is None:
        return None
    row = s.get(t.Session, session_id)
    return row.external_id if row else None


def session_reward(feedback: list[t.Feedback], reward_combine: str) -> float | None:
    """The session-level reward: every session-scoped reward combined as the tenant's policy says."""
    values = [f.reward for f in feedback if f.reward is not None and f.step_id is None]
    return combine_rewards(values, reward_combine) if values else None


def feedback_model(f: t.Feedback, session_external_id: str) -> m.Feedback:
    return m.Feedback(
        id=f.id, session_id=session_external_id, step_id=f.step_id, scope="step" if f.step_id else "session",
        reward=f.reward, comment=f.comment, correction=f.correction, source=f.source, posted_by=f.posted_by,
        idempotency_key=f.idempotency_key, late=f.late, created_at=f.created_at,
    )


def _step(st: t.Step, session_ext: str, contents: dict[str, Any], prompt_ids: list[int],
          tool_results: list[m.ToolResult], trained: dict[str, list[str]]) -> m.Step:
    output = contents.get(st.output_hash) if st.output_hash else None
    action = m.Action(
        text=(output or {}).get("text"),
        reasoning=(output or {}).get("reasoning"),
        tool_calls=[m.ToolCall(**tc) for tc in (output or {}).get("tool_calls", [])],
        output=(output or {}).get("output"),
    )
    messages = []
    for h in st.message_hashes:
        body = contents.get(h)
        role = body.get("role") if isinstance(body, dict) else None
        messages.append(m.Message(hash=h, role=role, content=body))
    return m.Step(
        id=st.id,
        session_id=session_ext,
        seq=st.seq,
        parent_step_id=st.parent_step_id,
        status=st.status,
        error=m.StepError(**st.error) if st.error else None,
        upstream=st.upstream,
        model=st.model,
        model_version=st.model_version,
        observation=m.Observation(
            api=st.api, system=_ref(st.system_hash, contents), tools=_ref(st.tools_hash, contents),
            history_len=st.history_len, messages=messages, tool_results=tool_results, params=st.params or {},
        ),
        action=action,
        tokens=m.TokenRecord(
            source=st.token_source, prompt_token_ids=prompt_ids, output_token_ids=list(st.output_token_ids),
            output_logprobs=[float(x) for x in st.output_logprobs],
            output_versions=[m.VersionRun(version=v, count=n) for v, n in st.output_versions],
            output_mask=list(st.output_mask) if st.output_mask is not None else None,
            finish_reason=st.finish_reason, prompt_path=st.prompt_path,
        ),
        timings=m.Timings(started_at=st.started_at, ttft_ms=st.ttft_ms, total_ms=st.total_ms),
        usage=m.Usage(prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens, cost=st.cost),
        governance=m.Governance(
            redaction=m.RedactionReport(counts=st.redaction or {}), eligibility=st.eligibility,
            eligibility_reason=st.eligibility_reason, visibility=st.visibility, retention_until=st.retention_until,
        ),
        trained_in=trained.get(st.id, []),
        replay_of=st.replay_of,
        layers=m.Layers(harness_version=st.harness_version, memory_version=st.memory_version,
                        memory_facts=list(st.memory_facts or [])),
    )


def version_model(s: Session, v: t.ModelVersion) -> m.ModelVersion:
    lineage = list(s.scalars(select(t.VersionLineage.step_id).where(t.VersionLineage.version_id == v.id)))
    return m.ModelVersion(
        id=v.id, name=v.name, parent=v.parent_id, checkpoint=v.checkpoint, status=v.status,
        training_run=v.training_run_id, metrics=v.metrics or {}, created_at=v.created_at, served_at=v.served_at,
        lineage=lineage, layer=v.layer, scope=v.tenant_id, spec=v.spec or {},
    )


def find_session(s: Session, session_id: str, tenant: str | None) -> t.Session | None:
    """A session by its public id (within `tenant`; None: any tenant) or its internal id.

    Raises LookupError when the public id names sessions of several tenants and no tenant was given.
    """
    q = select(t.Session).where(or_(t.Session.external_id == session_id, t.Session.id == session_id))
    if tenant is not None:
        q = q.where(t.Session.tenant_id == tenant)
    rows = list(s.scalars(q))
    exact = [r for r in rows if r.id == session_id]
    if exact:
        return exact[0]
    if len(rows) > 1:
        raise LookupError(f"session id {session_id!r} exists in {len(rows)} tenants: name the tenant")
    return rows[0] if rows else None
