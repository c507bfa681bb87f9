"""Forgets and writes of one tenant, one at a time, and a count of the tenant's forgets.

A forget deletes the contents no remaining step refers to. A writer that believes a content stored
(its cache, proxy.record.prepare) refers to it instead of writing it again. Two races follow, and
this module closes both:

- A forget and a write that overlap. The forget's check for orphans does not see the writer's
  uncommitted steps, and the writer's tombstone check does not see the forget's uncommitted
  tombstone. So each write transaction holds a shared lock per tenant of its batch, and each forget
  holds its tenants' locks exclusively, from its start to its commit (`lock_tenants`).
- A forget that committed before the write, but whose note had not reached the writer when it
  prepared the batch. Each forget that deletes contents adds one to `tenants.forgets` (`bump`) and
  announces the new count. A writer knows the count its cache reflects. When the database's count is
  ahead of it, the writer checks that the contents the batch refers to but does not carry are still
  stored (`missing_contents`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

from sqlalchemy import text
from sqlalchemy.orm import Session

from atdp_schema.models import Eligibility
from proxy.store.copy import text_array
from proxy.store.texts import ENCODED_KINDS, refs

if TYPE_CHECKING:
    from proxy.store.records import ContentRow, StepRecord

log = logging.getLogger("atdp.store")

# The (class, key) form of PostgreSQL's advisory locks: its keys never meet the single-bigint keys
# the swap and canary buses take (proxy.rollout.swapbus, canarybus).
LOCK_CLASS = 0x61746470 & 0x7FFFFFFF  # "atdp"

# Each distinct key once, in key order: two transactions over the same tenants, or over tenants whose
# keys collide, take their locks in one order and cannot deadlock.
_LOCK = ("SELECT {fn}(:cls, k) FROM (SELECT DISTINCT hashtext(t) AS k "
         "FROM unnest(CAST(:tenants AS text[])) AS t ORDER BY 1) AS keys")
LOCK_SHARED = _LOCK.format(fn="pg_advisory_xact_lock_shared")
LOCK_EXCLUSIVE = _LOCK.format(fn="pg_advisory_xact_lock")
BUMP = "UPDATE tenants SET forgets = forgets + 1 WHERE id = :tenant RETURNING forgets"
COUNTS = "SELECT id, forgets FROM tenants WHERE id = ANY(CAST(:tenants AS text[]))"
ALL_COUNTS = "SELECT id, forgets FROM tenants"
STORED = "SELECT hash FROM contents WHERE tenant_id = :tenant AND hash = ANY(CAST(:hashes AS text[]))"


def lock_tenants(s: Session, tenants: Iterable[str], *, shared: bool) -> None:
    """Hold the tenants' write locks until the transaction ends: shared for a write, exclusive for a
    forget. Run it before anything the lock protects is read: each later statement of the transaction
    then sees what a forget that held the lock committed."""
    ids = sorted(set(tenants))
    if ids:
        s.execute(text(LOCK_SHARED if shared else LOCK_EXCLUSIVE), {"cls": LOCK_CLASS, "tenants": text_array(ids)})


def bump(s: Session, tenant: str) -> int:
    """Count a forget that deleted contents of `tenant`; returns the new count (0: no such tenant)."""
    return s.execute(text(BUMP), {"tenant": tenant}).scalar() or 0


def counts(s: Session, tenants: Iterable[str] | None = None) -> dict[str, int]:
    """tenant -> forgets so far (of every tenant when None); a tenant without a row has had none."""
    if tenants is None:
        return dict(s.execute(text(ALL_COUNTS)).all())
    return dict(s.execute(text(COUNTS), {"tenants": text_array(sorted(set(tenants)))}).all())


def missing_contents(s: Session, tenant: str, hashes: Iterable[str]) -> set[str]:
    """Those of `hashes` the tenant has no content row for."""
    want = sorted(set(hashes))
    if not want:
        return set()
    return set(want) - set(s.scalars(text(STORED), {"tenant": tenant, "hashes": text_array(want)}))


class StaleContents(Exception):
    """A batch refers to contents a forget deleted after its writer's cache last heard of one: the
    writer drops them from its cache and prepares the batch again (proxy.record.recorder)."""

    def __init__(self, missing: dict[str, set[str]]) -> None:
        super().__init__(f"{sum(map(len, missing.values()))} content(s) the batch refers to were forgotten")
        self.missing = missing  # tenant -> hashes


STALE_REASON = "refers to contents a forget deleted before the step was stored"


def _referred(r: StepRecord, carried: Mapping[tuple[str, str], ContentRow]) -> set[str]:
    """Every content `r` refers to: its own references, and those of the rows of the batch they name."""
    tenant = r.session.tenant_id
    out: set[str] = set()
    todo = [h for h in (r.system_hash, r.tools_hash, r.output_hash, *r.message_hashes,
                        *(tr.result_hash for tr in r.tool_results), *(c.hash for c in r.contents)) if h]
    while todo:
        h = todo.pop()
        if h in out:
            continue
        out.add(h)
        row = carried.get((tenant, h))
        if row is not None and row.kind in ENCODED_KINDS and row.encoded:
            todo.extend(refs(row.body))
    return out


def check_references(s: Session, kept: list[StepRecord], carried: Mapping[tuple[str, str], ContentRow],
                     tenants: list[str], on_stale: Literal["raise", "quarantine"]) -> None:
    """The contents `kept` refers to but the batch does not carry, of `tenants`, are stored; else raise
    StaleContents, or (a record that cannot be prepared again: spooled, a dead letter) keep the step,
    quarantined: its text is gone, and with it what its token ids would be trained to."""
    referred = {r.id: _referred(r, carried) for r in kept if r.session.tenant_id in tenants}
    wanted: dict[str, set[str]] = {}
    for r in kept:
        if r.id in referred:
            wanted.setdefault(r.session.tenant_id, set()).update(
                h for h in referred[r.id] if (r.session.tenant_id, h) not in carried)
    missing = {tenant: gone for tenant, hashes in wanted.items() if (gone := missing_contents(s, tenant, hashes))}
    if not missing:
        return
    if on_stale == "raise":
        raise StaleContents(missing)
    hit = [r for r in kept if r.id in referred and referred[r.id] & missing[r.session.tenant_id]]
    for r in hit:
        r.eligibility, r.eligibility_reason = Eligibility.quarantined, STALE_REASON
    log.warning("%d step(s) refer to %d content(s) a forget deleted before they were stored; kept, quarantined",
                len(hit), sum(map(len, missing.values())))
