"""Registering a harness or memory candidate: from an operator's request or a diagnosis's proposal.

A harness candidate's overlay is validated (proxy.layers.overlay) and, for a proposal, added on top of
the overlay serving its scope; a memory candidate is the facts serving the tenant plus the new ones
(stored once each, proxy.store.layers.add_facts). Either is a `candidate` row: the gates decide.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from atdp_schema.models import VersionStatus
from proxy.layers.overlay import merge_overlays, parse_overlay
from proxy.store import tables as t
from proxy.store.layers import HARNESS, MEMORY, add_facts, add_version, serving_layer


class NothingNew(ValueError):
    """The candidate would change nothing of what serves its scope."""


def pending_of(s: Session, layer: str, tenant: str | None) -> t.ModelVersion | None:
    """A candidate of the layer and scope still before its gates' verdict (a proposal joins it)."""
    scope = t.ModelVersion.tenant_id.is_(None) if tenant is None else t.ModelVersion.tenant_id == tenant
    return s.scalars(select(t.ModelVersion).where(
        t.ModelVersion.layer == layer, scope,
        t.ModelVersion.status.in_((VersionStatus.candidate, VersionStatus.evaluating)))
        .order_by(t.ModelVersion.created_at).limit(1)).first()


def register_harness(s: Session, *, tenant: str | None, overlay: dict[str, Any], name: str | None, trigger: str,
                     actor: str, on_serving: bool, evidence: dict[str, Any] | None = None) -> t.ModelVersion:
    """`on_serving`: the overlay adds to the one serving the scope (a proposal); else it is the whole
    overlay (an operator's). Raises OverlayError (the spec) or NothingNew."""
    serving = serving_layer(s, HARNESS, tenant)
    base = (serving.spec or {}).get("overlay") if serving is not None else None
    spec = merge_overlays(base, overlay) if on_serving else dict(overlay)
    parse_overlay(spec)
    if base is not None and spec == base:
        raise NothingNew(f"the overlay is the one {serving.name} serves")
    return add_version(s, layer=HARNESS, tenant=tenant, spec={"overlay": spec}, name=name, trigger=trigger,
                       actor=actor, evidence=evidence)


def register_memory(s: Session, *, tenant: str, facts: list[tuple[str, dict[str, Any]]], name: str | None,
                    trigger: str, actor: str, evidence: dict[str, Any] | None = None) -> t.ModelVersion:
    """The serving memory's facts and these (texts redacted by the caller). Raises NothingNew."""
    serving = serving_layer(s, MEMORY, tenant)
    ids = [str(i) for i in ((serving.spec or {}).get("facts") or [])] if serving is not None else []
    new = [i for i in add_facts(s, tenant, facts, actor=actor) if i not in ids]
    if not new:
        raise NothingNew("every fact is in the serving memory already")
    return add_version(s, layer=MEMORY, tenant=tenant, spec={"facts": ids + list(dict.fromkeys(new))}, name=name,
                       trigger=trigger, actor=actor, evidence={**(evidence or {}), "new_facts": len(set(new))})
