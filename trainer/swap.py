"""Publishing a trained checkpoint: the version row with its lineage, then the swap via the proxy.

Order, so that the version and its lineage are consistent whatever fails:
1. the checkpoint is written atomically (trainer.checkpoint) under ATDP_HOME/checkpoints/<name>;
2. one transaction: a `candidate` model_versions row (parent = the version trained from), its
   version_lineage rows (step, reward, advantage), the steps' trained_version_id, leases cleared;
3. POST /atdp/v1/versions {"checkpoint", "name", "parent", "wait": true} with the trainer's key
   (ATDP_TRAINER_KEY: `atdp keys create --scope versions:write`; else the admin key): the proxy
   runs the candidate's gates (docs/control-plane.md) and, when they pass, swaps every replica; it
   answers with the final status (`serving`; `rejected` or `failed` + error, with the steps released).
   The trainer never uses the operator override: its versions always go through the gates (which
   are skipped, and the version promoted, while no evaluation set is configured).
If the proxy cannot be reached, the trainer marks the candidate failed itself (same release).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from sqlalchemy.exc import IntegrityError

from atdp_schema.models import VersionStatus
from proxy.store import tables as t
from proxy.store.ids import new_id
from proxy.store.versions import mark_failed, next_name
from trainer.lease import LineageRow, complete

log = logging.getLogger("atdp.trainer.swap")


@dataclass
class SwapOutcome:
    ok: bool
    version_id: str
    name: str
    status: str
    seconds: float | None
    error: str | None
    response: dict[str, Any] | None = None


def pick_name(factory) -> str:
    with factory() as s:
        return next_name(s)


def register_candidate(
    factory,
    *,
    name: str,
    checkpoint: str,
    parent_id: str | None,
    run_id: str | None,
    lineage: list[LineageRow],
    owner: str,
    metrics: dict[str, Any],
) -> tuple[str, str]:
    """(version id, name): the candidate row, its lineage and the trained marks, in one transaction.
    A name taken meanwhile (another trainer) gets a suffix."""
    for attempt in range(5):
        version_name = name if attempt == 0 else f"{name}.{new_id()[-6:]}"
        version_id = new_id()
        try:
            with factory() as s, s.begin():
                s.add(t.ModelVersion(id=version_id, name=version_name, parent_id=parent_id, checkpoint=checkpoint,
                                     status=VersionStatus.candidate, training_run_id=run_id, metrics=metrics,
                                     created_at=datetime.now(UTC)))
                s.flush()
                complete(s, version_id=version_id, lineage=lineage, owner=owner)
            return version_id, version_name
        except IntegrityError:
            continue
    raise RuntimeError(f"could not register version {name!r}")


def request_swap(
    factory,
    *,
    proxy_url: str,
    proxy_key: str | None,
    version_id: str,
    name: str,
    checkpoint: str,
    parent: str | None,
    timeout_s: float,
) -> SwapOutcome:
    """Ask the proxy to swap every replica to the version; the proxy records the status."""
    headers = {"authorization": f"Bearer {proxy_key}"} if proxy_key else {}
    body = {"checkpoint": checkpoint, "name": name, "parent": parent, "wait": True}
    try:
        resp = httpx.post(proxy_url.rstrip("/") + "/atdp/v1/versions", json=body, headers=headers,
                          timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as e:
        return _proxy_unreachable(factory, version_id, name, f"proxy unreachable: {type(e).__name__}: {e}")
    try:
        data = resp.json()
    except ValueError:
        data = {}
    if resp.status_code in (200, 502) and "status" in data:
        swap = data.get("swap") or {}
        return SwapOutcome(ok=data["status"] == VersionStatus.serving, version_id=version_id, name=name, status=data["status"],
                           seconds=swap.get("seconds"), error=swap.get("error") or data.get("error"), response=data)
    # Refused before any swap (auth, validation, proxy not ready): the candidate never served.
    message = (data.get("error") or {}).get("message") if isinstance(data.get("error"), dict) else None
    return _proxy_unreachable(factory, version_id, name, f"proxy answered {resp.status_code}: {message or resp.text[:300]}")


def _proxy_unreachable(factory, version_id: str, name: str, error: str) -> SwapOutcome:
    with factory() as s, s.begin():
        row = s.get(t.ModelVersion, version_id)
        status = row.status if row else "missing"
        if status == VersionStatus.candidate:  # the proxy never took it up
            mark_failed(s, version_id, error, actor="trainer")
            status = VersionStatus.failed
    log.error("swap of %s: %s", name, error)
    return SwapOutcome(ok=status == VersionStatus.serving, version_id=version_id, name=name, status=status, seconds=None,
                       error=error)
