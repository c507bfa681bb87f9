"""`atdp export`: ATDP records out, as an ATDP JSON document, JSONL training samples, Parquet or ATIF
trajectories (`proxy.tools.export_atif`).

Everything streams: sessions are read in keyset-paginated batches and each is written and dropped
before the next is read, so memory is bounded by the largest session, not by the export.

A training sample is one step: the full prompt ids (rebuilt from the stored prefix chain), the
output ids with their behaviour logprobs and per-token versions, the loss mask, and the reward (the
step's own, else the session's, each combined by the tenant's policy).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import IO, Any

import orjson
from sqlalchemy import exists, or_, select, tuple_
from sqlalchemy.orm import Session

from atdp_schema.models import ATDP_VERSION, Eligibility
from proxy.governance.policies import Policies
from proxy.governance.policy import TenantPolicy
from proxy.store import tables as t
from proxy.store.read import session_document, version_model
from proxy.store.rewards import combine_rewards
from proxy.store.tokens import TRAINABLE_SOURCES, rebuild_prompt_ids, unrle

FORMATS = ("atdp-json", "jsonl", "parquet", "atif")


@dataclass
class ExportFilter:
    session: str | None = None  # public id
    tenant: str | None = None
    eligible: bool = False  # only eligible steps with engine/rederived tokens
    since: datetime | None = None
    until: datetime | None = None

    def describe(self) -> dict[str, Any]:
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(self).items()}


def iter_sessions(s: Session, f: ExportFilter, batch_size: int = 100) -> Iterator[t.Session]:
    """Matching sessions, oldest first, a batch at a time (keyset pagination: no offset scans)."""
    conds = []
    if f.session is not None:
        conds.append(t.Session.external_id == f.session)
    if f.tenant is not None:
        conds.append(t.Session.tenant_id == f.tenant)
    if f.since is not None:
        conds.append(t.Session.started_at >= f.since)
    if f.until is not None:
        conds.append(t.Session.started_at < f.until)
    if f.eligible:
        conds.append(exists().where(t.Step.session_id == t.Session.id, t.Step.eligibility == Eligibility.eligible,
                                    t.Step.token_source.in_(TRAINABLE_SOURCES)))
    last: tuple[datetime, str] | None = None
    while True:
        q = select(t.Session).where(*conds)
        if last is not None:
            q = q.where(tuple_(t.Session.started_at, t.Session.id) > tuple_(*last))
        rows = s.scalars(q.order_by(t.Session.started_at, t.Session.id).limit(batch_size)).all()
        if not rows:
            return
        last = (rows[-1].started_at, rows[-1].id)
        yield from rows
        if len(rows) < batch_size:
            return


def _trainable(step_eligibility: str, token_source: str) -> bool:
    return step_eligibility == Eligibility.eligible and token_source in TRAINABLE_SOURCES


def session_samples(s: Session, session: t.Session, *, eligible_only: bool, policies: Policies,
                    seen: dict[str, TenantPolicy]) -> Iterator[dict[str, Any]]:
    """One training sample per step of a session (see the module docstring)."""
    steps = list(s.scalars(select(t.Step).where(t.Step.session_id == session.id).order_by(t.Step.seq)))
    if not steps:
        return
    # Ancestors are needed for every prompt's prefix, even where they are filtered out below.
    prompts = rebuild_prompt_ids({st.id: st for st in steps}, fetch=lambda i, sid: t.get_step(s, i, sid))
    policy = seen.get(session.tenant_id) or seen.setdefault(session.tenant_id, policies.policy_for(s, session.tenant_id))
    per_step: dict[str | None, list[float]] = defaultdict(list)
    for step_id, reward in s.execute(
        select(t.Feedback.step_id, t.Feedback.reward)
        .where(t.Feedback.session_id == session.id, t.Feedback.reward.is_not(None))
        .order_by(t.Feedback.created_at, t.Feedback.id)
    ):
        per_step[step_id].append(reward)
    session_reward = combine_rewards(per_step[None], policy.reward_combine) if per_step[None] else None
    for st in steps:
        if eligible_only and not _trainable(st.eligibility, st.token_source):
            continue
        own = per_step.get(st.id)
        output = list(st.output_token_ids)
        yield {
            "session_id": session.external_id,
            "step_id": st.id,
            "seq": st.seq,
            "tenant": session.tenant_id,
            "task_id": session.task_id,
            "model": st.model,
            "model_version": st.model_version,
            "prompt_ids": prompts[st.id],
            "output_ids": output,
            "behaviour_logprobs": [float(x) for x in st.output_logprobs],
            "versions": unrle(st.output_versions),
            "loss_mask": list(st.output_mask) if st.output_mask is not None else [1] * len(output),
            "reward": combine_rewards(own, policy.reward_combine) if own else session_reward,
            "token_source": st.token_source,
            "eligibility": st.eligibility,
        }


def parquet_schema():
    import pyarrow as pa

    return pa.schema([
        ("session_id", pa.string()), ("step_id", pa.string()), ("seq", pa.int32()), ("tenant", pa.string()),
        ("task_id", pa.string()), ("model", pa.string()), ("model_version", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())), ("output_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())), ("versions", pa.list_(pa.string())),
        ("loss_mask", pa.list_(pa.int8())), ("reward", pa.float64()), ("token_source", pa.string()),
        ("eligibility", pa.string()),
    ])


@dataclass
class ExportStats:
    sessions: int = 0
    steps: int = 0


def export(s: Session, f: ExportFilter, fmt: str, out: IO[bytes] | str, *, policies: Policies,
           batch_size: int = 100, row_group: int = 1024) -> ExportStats:
    """Write every record matching `f` to `out` (a binary stream; a path for Parquet)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, not {fmt!r}")
    stats = ExportStats()
    if fmt == "atdp-json":
        _export_document(s, f, out, batch_size, stats, policies)
        return stats
    if fmt == "atif":
        from proxy.tools.export_atif import write_atif

        stats.sessions, stats.steps = write_atif(
            s, iter_sessions(s, f, batch_size), out, eligible_only=f.eligible,
            reward_combine_for=lambda tenant: policies.policy_for(s, tenant).reward_combine)
        return stats
    seen: dict[str, TenantPolicy] = {}
    writer = None
    rows: list[dict] = []
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = parquet_schema()
        writer = pq.ParquetWriter(out, schema)

        def flush() -> None:
            if rows:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                rows.clear()
    try:
        for session in iter_sessions(s, f, batch_size):
            stats.sessions += 1
            for sample in session_samples(s, session, eligible_only=f.eligible, policies=policies, seen=seen):
                stats.steps += 1
                if writer is None:
                    out.write(orjson.dumps(sample) + b"\n")
                else:
                    rows.append(sample)
                    if len(rows) >= row_group:
                        flush()
            s.expunge_all()  # drop this session's rows: memory stays bounded
        if writer is not None:
            flush()
    finally:
        if writer is not None:
            writer.close()
    return stats


def _export_document(s: Session, f: ExportFilter, out: IO[bytes], batch_size: int, stats: ExportStats,
                     policies: Policies) -> None:
    """An ATDP `Document`, written piece by piece (sessions as they are read, then their versions)."""
    versions: set[str] = set()
    out.write(b'{"atdp_version":' + orjson.dumps(ATDP_VERSION) + b',"sessions":[')
    first = True
    for session in iter_sessions(s, f, batch_size):
        doc = session_document(s, session, reward_combine=policies.policy_for(s, session.tenant_id).reward_combine)
        if f.eligible:
            doc.steps = [st for st in doc.steps if _trainable(st.governance.eligibility, st.tokens.source)]
        for st in doc.steps:
            versions.update(st.trained_in)
            if st.model_version:
                versions.add(st.model_version)
            versions.update(run.version for run in st.tokens.output_versions)
        out.write((b"" if first else b",") + doc.model_dump_json().encode())
        first = False
        stats.sessions += 1
        stats.steps += len(doc.steps)
        s.expunge_all()
    out.write(b'],"versions":[')
    if versions:
        rows = s.scalars(select(t.ModelVersion).where(or_(t.ModelVersion.id.in_(versions), t.ModelVersion.name.in_(versions)))
                         .order_by(t.ModelVersion.created_at))
        out.write(b",".join(version_model(s, v).model_dump_json().encode() for v in rows))
    out.write(b"]}\n")


def audit_export(s: Session, f: ExportFilter, fmt: str, target: str, stats: ExportStats, actor: str = "cli") -> None:
    s.add(t.AuditEvent(actor=actor, tenant_id=f.tenant, action="export", target=target,
                       details={"format": fmt, "filter": f.describe(), "sessions": stats.sessions, "steps": stats.steps}))


# --- command line ----------------------------------------------------------------------------------


def _when(value: str) -> datetime:
    when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def register(sub) -> None:
    p = sub.add_parser("export", help="write ATDP records (JSON document, JSONL training samples, Parquet, "
                                      "ATIF trajectories, chat-format SFT JSONL)")
    p.add_argument("--for", dest="purpose", choices=("rl", "sft"), default="rl",
                   help="rl (default): ATDP records / engine-token samples; sft: chat-format JSONL for TRL's "
                   "SFTTrainer, one line per eligible assistant turn, provider steps included")
    p.add_argument("--provider-only", action="store_true",
                   help="with --for sft: only steps answered by a provider route (distillation data)")
    p.add_argument("--session", help="one session (public id)")
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument("--eligible", action="store_true",
                   help="only steps eligible for training, with engine or re-derived tokens")
    p.add_argument("--since", type=_when, help="sessions started at or after this ISO 8601 time")
    p.add_argument("--until", type=_when, help="sessions started before this ISO 8601 time")
    p.add_argument("--format", choices=FORMATS, default="atdp-json",
                   help="atdp-json (default), jsonl, parquet, or atif (Harbor's ATIF v1.4, one trajectory per line)")
    p.add_argument("--out", default="-", help="output file, or - for stdout (not for parquet)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from proxy.config import load_settings
    from proxy.store import db

    if args.purpose == "sft":
        return _cmd_sft(args)
    if args.provider_only:
        print("atdp export: --provider-only goes with --for sft", file=sys.stderr)
        return 2
    if args.format == "parquet" and args.out == "-":
        print("atdp export: parquet needs --out PATH", file=sys.stderr)
        return 2
    f = ExportFilter(session=args.session, tenant=args.tenant, eligible=args.eligible, since=args.since,
                     until=args.until)
    settings = load_settings()
    policies = Policies.from_settings(settings)
    engine = db.make_engine(db.database_url(settings))
    try:
        factory = db.session_factory(engine)
        with factory() as s, s.begin():
            if args.out == "-":
                stats = export(s, f, args.format, sys.stdout.buffer, policies=policies)
                sys.stdout.buffer.flush()
            elif args.format == "parquet":
                stats = export(s, f, args.format, args.out, policies=policies)
            else:
                with open(args.out, "wb") as out:
                    stats = export(s, f, args.format, out, policies=policies)
        with db.transaction(factory) as s:
            audit_export(s, f, args.format, args.out, stats)
    finally:
        engine.dispose()
    print(f"exported {stats.steps} steps from {stats.sessions} sessions ({args.format})", file=sys.stderr)
    return 0



def _cmd_sft(args) -> int:
    from proxy.config import load_settings
    from proxy.store import db
    from proxy.tools.export_sft import write_sft

    if args.format not in ("atdp-json", "jsonl") or args.eligible:
        print("atdp export --for sft writes JSONL of eligible steps: drop --format/--eligible", file=sys.stderr)
        return 2
    f = ExportFilter(session=args.session, tenant=args.tenant, since=args.since, until=args.until)
    engine = db.make_engine(db.database_url(load_settings()))
    try:
        factory = db.session_factory(engine)
        with factory() as s, s.begin():
            if args.out == "-":
                stats = write_sft(s, iter_sessions(s, f), sys.stdout.buffer, provider_only=args.provider_only)
                sys.stdout.buffer.flush()
            else:
                with open(args.out, "wb") as out:
                    stats = write_sft(s, iter_sessions(s, f), out, provider_only=args.provider_only)
        with db.transaction(factory) as s:
            audit_export(s, f, "sft-jsonl", args.out, ExportStats(sessions=stats.sessions, steps=stats.steps))
    finally:
        engine.dispose()
    print(f"exported {stats.steps} assistant turns from {stats.sessions} sessions (sft-jsonl; "
          f"{stats.skipped} skipped: content forgotten or not translatable)", file=sys.stderr)
    return 0
