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

BASE_NAME = "base"


EVER_SERVED = (VersionStatus.serving, VersionStatus.retired, VersionStatus.rolled_back)


@dataclass
class VersionRef:
    id: str
    name: str
    checkpoint: str


def serving_version(s: Session) -> t.ModelVersion | None:
    return s.scalars(
        select(t.ModelVersion).where(t.ModelVersion.status == VersionStatus.serving)
        .order_by(t.ModelVersion.served_at.desc().nulls_last(), t.ModelVersion.created_at.desc()).limit(1)
    ).first()


def find_version(s: Session, key: str) -> t.ModelVersion | None:
    """A version by id or by name."""
    return s.get(t.ModelVersion, key) or s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == key)).first()


def next_name(s: Session) -> str:
    """`v<N>`, N one more than the number of versions (the caller retries on a name clash)."""
    n = s.scalar(select(func.count()).select_from(t.ModelVersion)) or 0
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
        s.execute(update(t.ModelVersion).where(t.ModelVersion.status == VersionStatus.serving, t.ModelVersion.id != target.id)
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
