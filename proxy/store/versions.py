"""Model version rows: which version serves, naming, failed candidates, what a swap leaves behind.

Used by the proxy's swap orchestration (`proxy.control`) and by the trainer; no web imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from atdp_schema.models import VersionStatus
from proxy.store import tables as t
from proxy.store.write import pg_safe

BASE_NAME = "base"
POLICY = "policy"  # the weights' layer; harness and memory versions: proxy.store.layers


EVER_SERVED = (VersionStatus.serving, VersionStatus.retired, VersionStatus.rolled_back)


@dataclass
class VersionRef:
    id: str
    name: str
    checkpoint: str


def serving_version(s: Session) -> t.ModelVersion | None:
    return s.scalars(
        select(t.ModelVersion).where(t.ModelVersion.status == VersionStatus.serving, t.ModelVersion.layer == POLICY)
        .order_by(t.ModelVersion.served_at.desc().nulls_last(), t.ModelVersion.created_at.desc()).limit(1)
    ).first()


def find_version(s: Session, key: str) -> t.ModelVersion | None:
    """A version by id or by name."""
    return s.get(t.ModelVersion, key) or s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == key)).first()


def next_name(s: Session) -> str:
    """`v<N>`, N one more than the number of versions (the caller retries on a name clash)."""
    n = s.scalar(select(func.count()).select_from(t.ModelVersion).where(t.ModelVersion.layer == POLICY)) or 0
    while s.scalar(select(t.ModelVersion.id).where(t.ModelVersion.name == f"v{n}")):
        n += 1
    return f"v{n}"


def mark_failed(s: Session, version_id: str, error: str, *, actor: str = "system") -> int:
    """The candidate never served: status `failed` with the error, lineage kept, steps released.

    Returns how many steps were released for retraining.
    """
    s.execute(update(t.ModelVersion).where(t.ModelVersion.id == version_id)
              .values(status=VersionStatus.failed, error=error[:4000], retired_at=datetime.now(UTC)))
    released = s.execute(
        update(t.Step).where(t.Step.trained_version_id == version_id).values(trained_version_id=None)
    ).rowcount
    s.add(t.AuditEvent(actor=actor, action="version.failed", target=version_id,
                       details={"error": error[:500], "released_steps": released}))
    return released


def version_json(s: Session, v: t.ModelVersion, *, lineage: bool = True) -> dict[str, Any]:
    from proxy.store.read import version_model

    body = version_model(s, v).model_dump(mode="json")
    if not lineage:
        body["lineage"] = len(body["lineage"])
    body["error"] = v.error
    body["retired_at"] = v.retired_at.isoformat() if v.retired_at else None
    return body


def record_swap(s: Session, target: VersionRef, outcome: dict, *, actor: str, left_status: str, candidate: bool,
            left_id: str | None = None) -> None:
    """Statuses after a swap. Success: the target serves, the one(s) it replaced are `left_status`.
    Failure: a new candidate is `failed` (steps released); an existing version keeps its status."""
    now = datetime.now(UTC)
    if outcome["ok"]:
        s.execute(update(t.ModelVersion).where(t.ModelVersion.status == VersionStatus.serving, t.ModelVersion.id != target.id,
                                               t.ModelVersion.layer == POLICY)
                  .values(status=left_status, retired_at=now))
        s.execute(update(t.ModelVersion).where(t.ModelVersion.id == target.id)
                  .values(status=VersionStatus.serving, served_at=now, retired_at=None, error=None))
        s.add(t.AuditEvent(actor=actor, action="version.rollback" if left_id else "version.swap", target=target.id,
                           details={"name": target.name, "seconds": round(outcome["seconds"], 4),
                                    "replicas": outcome["replicas"], "left": left_id}))
    elif candidate:
        mark_failed(s, target.id, outcome["error"], actor=actor)
    else:
        s.add(t.AuditEvent(actor=actor, action="version.swap_failed", target=target.id,
                           details={"name": target.name, "error": outcome["error"]}))


def swap_result(s: Session, version_id: str, outcome: dict, left_id: str | None = None) -> dict[str, Any]:
    body = version_json(s, s.get(t.ModelVersion, version_id, populate_existing=True), lineage=False)
    body["swap"] = {k: outcome.get(k) for k in ("ok", "error", "seconds", "replicas")}
    if left_id is not None:
        left = s.get(t.ModelVersion, left_id, populate_existing=True)
        body["rolled_back"] = {"id": left.id, "name": left.name, "status": left.status}
    return body


# --- the lifecycle's gates (docs/control-plane.md) ---------------------------------------------------

REPLAY_GATE = "replay_eval"
SAFETY_GATE = "safety"
GATES = (REPLAY_GATE, SAFETY_GATE)  # in the order they are shown
OVERRIDE_ACTION = "version.promote_override"


def set_status(s: Session, version_id: str, status: str) -> None:
    s.execute(update(t.ModelVersion).where(t.ModelVersion.id == version_id).values(status=status))


def set_gate(s: Session, version_id: str, gate: str, state: str, numbers: dict[str, Any] | None = None, *,
             finished: bool = False) -> None:
    """Insert or update one gate row of a version. Numbers quote model answers, which may hold NUL."""
    numbers = pg_safe(numbers) if numbers is not None else None
    row = s.get(t.VersionGate, (version_id, gate))
    if row is None:
        row = t.VersionGate(version_id=version_id, gate=gate, state=state, numbers=numbers or {},
                            started_at=datetime.now(UTC))
        s.add(row)
    row.state = state
    if state == "running":  # (again, after a restart): when this run began
        row.started_at = datetime.now(UTC)
    if numbers is not None:
        row.numbers = numbers
    row.finished_at = datetime.now(UTC) if finished else None


def gates_json(s: Session, version_id: str) -> list[dict[str, Any]]:
    rows = s.scalars(select(t.VersionGate).where(t.VersionGate.version_id == version_id)
                     .order_by(t.VersionGate.started_at, t.VersionGate.gate)).all()
    return [{"gate": g.gate, "state": g.state, "numbers": g.numbers,
             "started_at": g.started_at.isoformat() if g.started_at else None,
             "finished_at": g.finished_at.isoformat() if g.finished_at else None} for g in rows]


def override_of(s: Session, version_id: str) -> dict[str, Any] | None:
    """Who promoted the version past its gates, and when (the audit row), or None."""
    row = s.scalars(select(t.AuditEvent).where(t.AuditEvent.target == version_id,
                                               t.AuditEvent.action == OVERRIDE_ACTION)
                    .order_by(t.AuditEvent.at).limit(1)).first()
    return {"actor": row.actor, "at": row.at.isoformat(), **row.details} if row else None


def record_override(s: Session, version_id: str, *, actor: str, reason: str | None) -> None:
    s.add(t.AuditEvent(actor=actor, action=OVERRIDE_ACTION, target=version_id,
                       details={"promote": "now", "reason": reason}))
    for gate in GATES:
        set_gate(s, version_id, gate, "overridden", {"by": actor, "reason": reason}, finished=True)


def superseded_by(s: Session, version_id: str) -> str | None:
    """The name of a version registered after `version_id` that serves now, if one does: a candidate
    that waited for evaluation cases meanwhile is out of date (promoting it would put an older
    version in place of a newer one that passed its own gates)."""
    mine = select(t.ModelVersion.created_at).where(t.ModelVersion.id == version_id).scalar_subquery()
    layer = select(t.ModelVersion.layer).where(t.ModelVersion.id == version_id).scalar_subquery()
    scope = select(t.ModelVersion.tenant_id).where(t.ModelVersion.id == version_id).scalar_subquery()
    return s.scalar(select(t.ModelVersion.name).where(t.ModelVersion.status == VersionStatus.serving,
                                                      t.ModelVersion.layer == layer,
                                                      t.ModelVersion.tenant_id.is_not_distinct_from(scope),
                                                      t.ModelVersion.created_at > mine).limit(1))


def mark_rejected(s: Session, version_id: str, reasons: list[str], *, actor: str = "system") -> int:
    """A gate failed: status `rejected` with the reasons; like a failed swap, its steps are released so a
    later update can train on them (its lineage rows stay: what was tried)."""
    s.execute(update(t.ModelVersion).where(t.ModelVersion.id == version_id)
              .values(status=VersionStatus.rejected, error="; ".join(reasons)[:4000], retired_at=datetime.now(UTC)))
    released = s.execute(
        update(t.Step).where(t.Step.trained_version_id == version_id).values(trained_version_id=None)
    ).rowcount
    s.add(t.AuditEvent(actor=actor, action="version.rejected", target=version_id,
                       details={"reasons": reasons[:20], "released_steps": released}))
    return released


def version_detail(s: Session, version_id: str) -> dict[str, Any]:
    """GET /atdp/v1/versions/{id}: the version, every gate's state and numbers, and the override if any."""
    v = s.get(t.ModelVersion, version_id, populate_existing=True)
    body = version_json(s, v, lineage=False)
    body["gates"] = gates_json(s, v.id)
    body["override"] = override_of(s, v.id)
    return body
