"""Harness and memory versions, and memory's facts: the rows (migration 0017).

A harness or memory version is a `model_versions` row with its `layer`, its scope (`tenant_id`, NULL for
every tenant; memory is always one tenant's) and its `spec` (the overlay, or `{"facts": [ids]}`). It has
the statuses, gates, card and rollback of a weight version; promoting one moves no weights, only the
row (the proxies read which versions serve: proxy.layers.serving).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.dialects.postgresql import array
from sqlalchemy.orm import Session

from atdp_schema.models import VersionStatus
from proxy.store import tables as t
from proxy.store.canary import CanaryRef, canary_of
from proxy.store.ids import new_id

HARNESS, MEMORY, POLICY = "harness", "memory", "policy"
LAYERS = (HARNESS, MEMORY)
PREFIX = {HARNESS: "h", MEMORY: "m"}
ACTIVE = (VersionStatus.serving, VersionStatus.canary)


@dataclass(frozen=True)
class LayerRow:
    id: str
    name: str
    layer: str
    tenant: str | None
    status: str
    spec: dict[str, Any]
    canary: CanaryRef | None = None  # in its canary: the canary (its fraction, tenants, start)


def _row(s: Session, v: t.ModelVersion) -> LayerRow:
    canary = canary_of(s, v.id) if v.status == VersionStatus.canary else None
    return LayerRow(v.id, v.name, v.layer, v.tenant_id, v.status, dict(v.spec or {}), canary)


def layer_row(s: Session, version_id: str) -> LayerRow | None:
    v = s.get(t.ModelVersion, version_id, populate_existing=True)
    return _row(s, v) if v is not None and v.layer in LAYERS else None


def active_layers(s: Session) -> list[LayerRow]:
    """Every harness and memory version that serves or is in its canary."""
    rows = s.scalars(select(t.ModelVersion).where(t.ModelVersion.layer.in_(LAYERS), t.ModelVersion.status.in_(ACTIVE))
                     .order_by(t.ModelVersion.served_at.desc().nulls_last(), t.ModelVersion.created_at.desc())).all()
    return [_row(s, v) for v in rows]


def layer_canaries(s: Session) -> list[LayerRow]:
    """The harness and memory versions in a canary now (each proxy's start-up resumes their monitors)."""
    return [r for r in active_layers(s) if r.canary is not None]


def serving_layer(s: Session, layer: str, tenant: str | None) -> t.ModelVersion | None:
    """The version of `layer` serving exactly this scope (a tenant's own, or the global one: None)."""
    scope = t.ModelVersion.tenant_id.is_(None) if tenant is None else t.ModelVersion.tenant_id == tenant
    return s.scalars(select(t.ModelVersion).where(t.ModelVersion.layer == layer, scope,
                                                  t.ModelVersion.status == VersionStatus.serving)
                     .order_by(t.ModelVersion.served_at.desc().nulls_last()).limit(1)).first()


def next_layer_name(s: Session, layer: str) -> str:
    """`h<N>` / `m<N>`: one more than the layer's versions (the caller retries on a clash)."""
    n = (s.scalar(select(func.count()).select_from(t.ModelVersion).where(t.ModelVersion.layer == layer)) or 0) + 1
    while s.scalar(select(t.ModelVersion.id).where(t.ModelVersion.name == f"{PREFIX[layer]}{n}")):
        n += 1
    return f"{PREFIX[layer]}{n}"


def add_version(s: Session, *, layer: str, tenant: str | None, spec: dict[str, Any], name: str | None,
                trigger: str, actor: str, evidence: dict[str, Any] | None = None) -> t.ModelVersion:
    """A `candidate` of `layer` for the scope, its parent the version serving that scope now."""
    parent = serving_layer(s, layer, tenant)
    row = t.ModelVersion(id=new_id(), name=name or next_layer_name(s, layer), layer=layer, tenant_id=tenant,
                         spec=spec, parent_id=parent.id if parent else None, checkpoint=None,
                         status=VersionStatus.candidate, metrics={"trigger": trigger, **({"evidence": evidence}
                                                                                          if evidence else {})})
    s.add(row)
    s.flush()
    s.add(t.AuditEvent(actor=actor, action="version.registered", target=row.id,
                       details={"name": row.name, "layer": layer, "scope": tenant, "trigger": trigger}))
    return row


def promote(s: Session, version_id: str, *, actor: str) -> str | None:
    """The candidate serves its scope; the version that served it is `retired`. Returns that one's name."""
    v = s.get(t.ModelVersion, version_id, populate_existing=True)
    assert v is not None and v.layer in LAYERS
    before = serving_layer(s, v.layer, v.tenant_id)
    now = datetime.now(UTC)
    if before is not None and before.id != v.id:
        before.status, before.retired_at = VersionStatus.retired, now
    v.status, v.served_at, v.retired_at, v.error = VersionStatus.serving, now, None, None
    s.add(t.AuditEvent(actor=actor, action="version.promote", target=v.id,
                       details={"name": v.name, "layer": v.layer, "scope": v.tenant_id,
                                "left": before.name if before is not None and before.id != v.id else None}))
    return before.name if before is not None and before.id != v.id else None


def rollback(s: Session, version_id: str, *, actor: str) -> str | None:
    """The serving (or canary) version is `rolled_back`; the version of its layer and scope that served
    before it serves again (None: none did, the scope goes back to no overlay / no memory)."""
    v = s.get(t.ModelVersion, version_id, populate_existing=True)
    assert v is not None and v.layer in LAYERS
    was_serving = v.status == VersionStatus.serving
    now = datetime.now(UTC)
    v.status, v.retired_at = VersionStatus.rolled_back, now
    restored = None
    if was_serving:
        scope = t.ModelVersion.tenant_id.is_(None) if v.tenant_id is None else t.ModelVersion.tenant_id == v.tenant_id
        restored = s.scalars(select(t.ModelVersion).where(
            t.ModelVersion.layer == v.layer, scope, t.ModelVersion.id != v.id,
            t.ModelVersion.status == VersionStatus.retired, t.ModelVersion.served_at.is_not(None),
            t.ModelVersion.served_at < v.served_at).order_by(t.ModelVersion.served_at.desc()).limit(1)).first()
        if restored is not None:
            restored.status, restored.served_at, restored.retired_at = VersionStatus.serving, now, None
    s.execute(update(t.Step).where(t.Step.trained_version_id == v.id).values(trained_version_id=None))
    s.add(t.AuditEvent(actor=actor, action="version.rollback", target=v.id,
                       details={"name": v.name, "layer": v.layer, "scope": v.tenant_id,
                                "restored": restored.name if restored else None}))
    return restored.name if restored else None


# --- memory's facts ----------------------------------------------------------------------------------

def add_facts(s: Session, tenant: str, facts: Iterable[tuple[str, dict[str, Any]]], *, actor: str) -> list[str]:
    """Insert facts (text already redacted, and what supplied each); returns their ids, in order. A text
    the tenant's memory holds already is not stored twice: its id is returned."""
    ids = []
    for body, source in facts:
        have = s.scalar(select(t.MemoryFact.id).where(t.MemoryFact.tenant_id == tenant, t.MemoryFact.text == body))
        if have is None:
            have = new_id()
            s.add(t.MemoryFact(id=have, tenant_id=tenant, text=body, source=source, created_by=actor))
        ids.append(have)
    s.flush()
    return ids


def facts_of(s: Session, tenant: str, ids: list[str]) -> list[t.MemoryFact]:
    rows = {f.id: f for f in s.scalars(select(t.MemoryFact).where(t.MemoryFact.tenant_id == tenant,
                                                                   t.MemoryFact.id.in_(ids)))}
    return [rows[i] for i in ids if i in rows]


# The question's words that discriminate: each must be in at least one and at most half of the memory's
# facts (a document-frequency cut, like a max_df of 0.5; one fact alone keeps every word it matches).
# Words every fact shares ("service", "port") would otherwise bring facts about other things into a
# question none of them answers, and a small model copies what it is shown. The words too common to
# search with are read once per memory version (`common_lexemes`, a scan of its facts); a call's search
# then needs no count per word (a word in no fact matches nothing, so "at least one" holds by itself).
# Its plan still filters the tenant's facts rather than starting from the GIN index: about 3 ms at
# 2,000 facts (docs/benchmarks.md, "Layers on the request path").
COMMON = text("""
WITH f AS (SELECT m.tsv FROM memory_facts m JOIN unnest(CAST(:ids AS varchar[])) v(id) ON v.id = m.id
            WHERE m.tenant_id = :tenant)
SELECT x FROM f, unnest(tsvector_to_array(f.tsv)) x
 GROUP BY x HAVING count(*) > greatest(1, (SELECT count(*) FROM f) * 0.5)""")

_SEARCH = """
WITH lexemes AS (  -- the words as the facts' vectors hold them (stemmed, stop words gone: no notices)
    SELECT DISTINCT x FROM unnest(CAST(:terms AS text[])) w, unnest(tsvector_to_array(to_tsvector('english', w))) x
     WHERE x <> ALL(CAST(:common AS text[]))),
q AS (SELECT to_tsquery('simple', string_agg(x, ' | ')) AS q FROM lexemes)
SELECT m.id, m.text
  FROM memory_facts m, q
 WHERE q.q IS NOT NULL AND m.tenant_id = :tenant AND m.tsv @@ q.q {members}
 ORDER BY ts_rank_cd(m.tsv, q.q) DESC, m.created_at, m.id
 LIMIT :k"""
# The tenant's best matches, filtered to the version's facts here: sending the version's fact ids with
# every search cost more than the search (about 10 ms for 2,000 ids). Facts outside the version (a
# candidate's, a rejected one's) are few; when they crowd the first rows, the search runs again with the
# ids in the query.
SEARCH_TENANT = text(_SEARCH.replace("{members}", ""))
SEARCH_MEMBERS = text(_SEARCH.replace(
    "{members}", "AND m.id IN (SELECT unnest(CAST(:ids AS varchar[])))"))
OVERFETCH = 16


def common_lexemes(s: Session, tenant: str, ids: Collection[str]) -> frozenset[str]:
    """The words (as lexemes) in more than half of these facts, and in more than one: too common to search with."""
    if not ids:
        return frozenset()
    return frozenset(s.scalars(COMMON, {"tenant": tenant, "ids": list(ids)}))


def search(s: Session, tenant: str, ids: Collection[str], terms: list[str], k: int,
           common: frozenset[str] | None = None) -> list[tuple[str, str]]:
    """The `k` facts among `ids` that best match the discriminating ones of `terms` (the question's
    words, proxy.layers.memory.query_terms: letters and digits only, so no term is a tsquery error).
    `common`: `common_lexemes(ids)`, when the caller keeps it (read here otherwise)."""
    if not ids or not terms:
        return []
    members = ids if isinstance(ids, frozenset) else frozenset(ids)
    if common is None:
        common = common_lexemes(s, tenant, members)
    params = {"terms": terms, "tenant": tenant, "common": sorted(common), "k": k + OVERFETCH}
    rows = s.execute(SEARCH_TENANT, params).all()
    found = [(r.id, r.text) for r in rows if r.id in members][:k]
    if len(found) < k and len(rows) == k + OVERFETCH:  # others crowded the version's facts out
        rows = s.execute(SEARCH_MEMBERS, {**params, "k": k, "ids": list(members)}).all()
        found = [(r.id, r.text) for r in rows]
    return found


def forget_facts(s: Session, tenant: str, session_ids: list[str] | None) -> int:
    """Delete the facts that forgotten sessions supplied (None: every fact of the tenant). A memory
    version that listed one simply no longer finds it."""
    q = delete(t.MemoryFact).where(t.MemoryFact.tenant_id == tenant)
    if session_ids is not None:
        if not session_ids:
            return 0
        q = q.where(t.MemoryFact.source["sessions"].op("?|")(array(session_ids)))
    return s.execute(q).rowcount or 0
