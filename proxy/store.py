"""Writing ATDP records: a batch of redacted step records in one transaction.

A `StepRecord` is what leaves the redaction stage: every text in it is already redacted, so it may
go to PostgreSQL or, when the database is away, to the spool. It is plain JSON-able data.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from proxy import tables as t

log = logging.getLogger("atdp.store")


@dataclass
class ContentRow:
    hash: str
    kind: str  # message | system | tools | output | text
    body: Any  # redacted
    size: int
    redaction: dict[str, int] = field(default_factory=dict)


@dataclass
class ToolCallRow:
    call_id: str
    name: str
    arguments: Any  # redacted


@dataclass
class ToolResultRow:
    call_id: str
    result_hash: str | None
    is_error: bool = False


@dataclass
class SessionInfo:
    tenant_id: str
    external_id: str
    client: str | None = None
    client_info: dict[str, Any] = field(default_factory=dict)
    task_id: str | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    replay_of: str | None = None  # internal id of the original session


@dataclass
class StepRecord:
    id: str
    session: SessionInfo
    api: str
    status: str
    started_at: datetime
    parent_step_id: str | None = None
    error: dict[str, Any] | None = None
    upstream: str | None = None
    model: str | None = None
    model_version: str | None = None
    system_hash: str | None = None
    tools_hash: str | None = None
    history_len: int = 0
    message_hashes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    transcript_hash: str | None = None
    output_hash: str | None = None
    contents: list[ContentRow] = field(default_factory=list)
    tool_calls: list[ToolCallRow] = field(default_factory=list)
    tool_results: list[ToolResultRow] = field(default_factory=list)
    token_source: str = "none"
    prompt_prefix_len: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)  # suffix after prompt_prefix_len
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[list[Any]] = field(default_factory=list)  # [[version_id, count], ...]
    output_mask: list[int] | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None
    redaction: dict[str, int] = field(default_factory=dict)
    eligibility: str = "eligible"
    eligibility_reason: str = ""
    visibility: str = "tenant"
    retention_until: datetime | None = None
    replay_of: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRecord:
        data = dict(data)
        data["session"] = SessionInfo(**data["session"])
        data["contents"] = [ContentRow(**c) for c in data.get("contents", [])]
        data["tool_calls"] = [ToolCallRow(**c) for c in data.get("tool_calls", [])]
        data["tool_results"] = [ToolResultRow(**c) for c in data.get("tool_results", [])]
        for key in ("started_at", "retention_until"):
            if isinstance(data.get(key), str):
                data[key] = datetime.fromisoformat(data[key])
        return cls(**data)


def rle(values: list[str]) -> list[list[Any]]:
    """Run-length encode per-token versions: ["a","a","b"] -> [["a", 2], ["b", 1]]."""
    runs: list[list[Any]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def unrle(runs: list[list[Any]]) -> list[str]:
    return [v for v, n in runs for _ in range(n)]


def ensure_tenant(s: Session, tenant_id: str) -> None:
    s.execute(insert(t.Tenant).values(id=tenant_id).on_conflict_do_nothing())


def _upsert_session(s: Session, info: SessionInfo, started_at: datetime, new_id: str) -> str:
    """Find or create the session by (tenant, public id); returns its internal id."""
    stmt = (
        insert(t.Session)
        .values(
            id=new_id,
            tenant_id=info.tenant_id,
            external_id=info.external_id,
            client=info.client,
            client_info=info.client_info,
            task_id=info.task_id,
            labels=info.labels,
            started_at=started_at,
            last_step_at=started_at,
            replay_of=info.replay_of,
        )
        .on_conflict_do_update(
            constraint="uq_sessions_tenant_external",
            set_={
                "last_step_at": func.greatest(t.Session.last_step_at, started_at),
                "task_id": func.coalesce(t.Session.task_id, info.task_id),
                "client": func.coalesce(t.Session.client, info.client),
            },
        )
        .returning(t.Session.id)
    )
    return s.execute(stmt).scalar_one()


def write_steps(s: Session, records: list[StepRecord], new_session_id) -> int:
    """Insert a batch of step records (idempotent by step id). Returns how many were new.

    `new_session_id` mints the internal id of a session seen for the first time.
    Steps are written in the order given; `seq` continues the session's numbering.
    """
    if not records:
        return 0
    for tenant in {r.session.tenant_id for r in records}:
        ensure_tenant(s, tenant)

    # Contents first (deduplicated across the batch; existing rows are left alone).
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        for c in r.contents:
            rows.setdefault(
                (r.session.tenant_id, c.hash),
                {"tenant_id": r.session.tenant_id, "hash": c.hash, "kind": c.kind, "body": c.body,
                 "size": c.size, "redaction": c.redaction},
            )
    if rows:
        ordered = [rows[k] for k in sorted(rows)]  # stable lock order across concurrent writers
        for i in range(0, len(ordered), 500):
            s.execute(insert(t.Content).values(ordered[i : i + 500]).on_conflict_do_nothing())

    existing = set(
        s.scalars(select(t.Step.id).where(t.Step.id.in_([r.id for r in records]))).all()
    )
    written = 0
    session_ids: dict[tuple[str, str], str] = {}
    for r in records:
        if r.id in existing:  # already written (spool replay after a partial failure)
            continue
        key = (r.session.tenant_id, r.session.external_id)
        sid = session_ids.get(key)
        if sid is None:
            sid = _upsert_session(s, r.session, r.started_at, new_session_id())
            # Serialise seq assignment per session across writers.
            s.execute(select(t.Session.id).where(t.Session.id == sid).with_for_update())
            session_ids[key] = sid
        else:
            s.execute(
                update(t.Session)
                .where(t.Session.id == sid)
                .values(last_step_at=func.greatest(t.Session.last_step_at, r.started_at))
            )
        seq = (s.execute(select(func.coalesce(func.max(t.Step.seq), 0)).where(t.Step.session_id == sid)).scalar_one()) + 1
        s.add(
            t.Step(
                id=r.id, session_id=sid, tenant_id=r.session.tenant_id, seq=seq, parent_step_id=r.parent_step_id,
                api=r.api, status=r.status, error=r.error, upstream=r.upstream, model=r.model,
                model_version=r.model_version, system_hash=r.system_hash, tools_hash=r.tools_hash,
                history_len=r.history_len, message_hashes=r.message_hashes, params=r.params,
                transcript_hash=r.transcript_hash, output_hash=r.output_hash, token_source=r.token_source,
                prompt_prefix_len=r.prompt_prefix_len, prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids, output_logprobs=r.output_logprobs,
                output_versions=r.output_versions, output_mask=r.output_mask, finish_reason=r.finish_reason,
                started_at=r.started_at, ttft_ms=r.ttft_ms, total_ms=r.total_ms, prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens, cost=r.cost, redaction=r.redaction,
                eligibility=r.eligibility, eligibility_reason=r.eligibility_reason, visibility=r.visibility,
                retention_until=r.retention_until, replay_of=r.replay_of,
            )
        )
        s.flush()
        for tc in r.tool_calls:
            s.execute(
                insert(t.ToolCall)
                .values(step_id=r.id, call_id=tc.call_id, session_id=sid, tenant_id=r.session.tenant_id,
                        name=tc.name, arguments=tc.arguments)
                .on_conflict_do_nothing()
            )
        for tr in r.tool_results:
            # Link the result to the call that asked for it (same session; latest call with that id).
            s.execute(
                update(t.ToolCall)
                .where(t.ToolCall.session_id == sid, t.ToolCall.call_id == tr.call_id,
                       t.ToolCall.result_step_id.is_(None))
                .values(result_step_id=r.id, result_hash=tr.result_hash, is_error=tr.is_error)
            )
        written += 1
    return written


def full_prompt_ids(s: Session, step: t.Step) -> list[int]:
    """Rebuild a step's full prompt ids from its stored suffix and its ancestors' tokens."""
    if step.prompt_prefix_len == 0 or step.parent_step_id is None:
        return list(step.prompt_token_ids)
    parent = s.get(t.Step, step.parent_step_id)
    if parent is None:
        raise LookupError(f"step {step.id}: parent {step.parent_step_id} is missing; prefix cannot be rebuilt")
    prefix = full_prompt_ids(s, parent) + list(parent.output_token_ids)
    return prefix[: step.prompt_prefix_len] + list(step.prompt_token_ids)
