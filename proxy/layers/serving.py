"""Which harness and memory versions a call gets, and applying them to its body.

Each proxy keeps the harness and memory versions that serve or are in their canary (a few rows) in
memory, read again every `ATDP_LAYERS_REFRESH_S` and at once after this proxy promotes or rolls one
back, so a call costs no database read for the harness; memory costs one indexed full-text search
(proxy.store.layers.search), only when a memory version serves the call's tenant and the call's last
message is the user's.

Scope: a tenant's own version, else the global one (harness; memory is always a tenant's). A version in
its canary (proxy.rollout.layer_canary) serves its arm of the new sessions: a session's arm is decided by
its first call during the canary and stored (`canary_sessions`, as for a weight version's canary: the
same on every proxy and after a restart); sessions begun before it and the serving arm get the serving
version. Each proxy keeps the arms it has seen, so a session costs one database write per canary.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from atdp_schema.models import VersionStatus
from proxy.layers.memory import query_terms, question_text, with_facts
from proxy.layers.overlay import HarnessOverlay, OverlayError, apply_harness, parse_overlay
from proxy.store.canary import BEFORE, CANDIDATE, CanaryRef, assign_now
from proxy.store.layers import HARNESS, MEMORY, LayerRow, active_layers, common_lexemes, search

log = logging.getLogger("atdp.layers")

# How long the words too common to search with stay as read for a memory version: a forget that drops
# some of its facts shifts them a little, so they are read again now and then, never on a call's path.
COMMON_TTL_S = 60.0


@dataclass(frozen=True)
class LayerVersion:
    id: str
    name: str
    layer: str
    tenant: str | None
    overlay: HarnessOverlay | None = None  # harness
    facts: frozenset[str] = frozenset()  # memory: the facts' ids
    canary: CanaryRef | None = None  # in its canary: which sessions it serves


@dataclass
class Applied:
    """What a call was sent with: recorded on its step and named in its response headers."""

    harness: LayerVersion | None = None
    memory: LayerVersion | None = None
    facts: list[str] | None = None  # ids of the facts put into the context (None: memory not searched)


@dataclass
class _Scope:
    serving: LayerVersion | None = None
    canary: LayerVersion | None = None


def layer_version(row: LayerRow) -> LayerVersion | None:
    if row.layer == HARNESS:
        try:
            overlay = parse_overlay(row.spec.get("overlay"))
        except OverlayError as e:  # checked when registered; a row edited by hand is skipped, loudly
            log.error("harness version %s is not applied: %s", row.name, e)
            return None
        return LayerVersion(row.id, row.name, row.layer, row.tenant, overlay=overlay, canary=row.canary)
    facts = frozenset(str(f) for f in row.spec.get("facts") or [])
    return LayerVersion(row.id, row.name, row.layer, row.tenant, facts=facts, canary=row.canary)


@dataclass
class Layers:
    factory: sessionmaker[Session] | None = None
    refresh_s: float = 2.0
    top_k: int = 3
    scopes: dict[tuple[str, str | None], _Scope] = field(default_factory=dict)
    loaded_at: float = 0.0
    canaries: frozenset[str] = frozenset()  # ids of the versions in a canary, as last read
    arms: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (canary, tenant, session) -> arm
    # memory version id -> (when read, its common words: proxy.store.layers.common_lexemes)
    common: dict[str, tuple[float, frozenset[str]]] = field(default_factory=dict)
    max_arms: int = 100_000
    # One reload at a time, reading and setting together: a periodic read begun before a promotion
    # committed must not land after the promoting proxy's own reload.
    reloading: threading.Lock = field(default_factory=threading.Lock)

    @property
    def active(self) -> bool:
        return bool(self.scopes)

    def reload(self) -> None:
        """Read the active versions (blocking: call it on a thread)."""
        if self.factory is None:
            return
        with self.reloading:
            self._reload(self.factory)

    def _reload(self, factory: sessionmaker[Session]) -> None:
        with factory() as s:
            rows = active_layers(s)
            now = time.monotonic()
            common: dict[str, tuple[float, frozenset[str]]] = {}
            for row in rows:
                if row.layer == MEMORY and row.tenant is not None:
                    held = self.common.get(row.id)
                    common[row.id] = held if held is not None and now - held[0] < COMMON_TTL_S else (
                        now, common_lexemes(s, row.tenant, [str(f) for f in row.spec.get("facts") or []]))
        scopes: dict[tuple[str, str | None], _Scope] = {}
        for row in rows:
            v = layer_version(row)
            if v is None:
                continue
            scope = scopes.setdefault((row.layer, row.tenant), _Scope())
            if row.status == VersionStatus.canary:
                scope.canary = scope.canary or v
            else:
                scope.serving = scope.serving or v
        canaries = frozenset(scope.canary.id for scope in scopes.values() if scope.canary is not None)
        if canaries != self.canaries:  # a canary ended: its arms are done with
            held = list(self.arms.items())  # one step under the GIL: the event loop adds arms meanwhile
            self.arms = {key: arm for key, arm in held if key[0] in canaries}
        self.scopes, self.canaries, self.common, self.loaded_at = scopes, canaries, common, time.monotonic()

    async def run(self, stopping: threading.Event) -> None:
        """Re-read every `refresh_s` (versions another proxy promoted); the database may be away."""
        while not stopping.is_set():
            try:
                await asyncio.to_thread(self.reload)
            except Exception as e:
                log.warning("could not read the serving harness and memory versions: %s", type(e).__name__)
            await asyncio.sleep(self.refresh_s)

    async def pick(self, layer: str, tenant: str, session_id: str, *, continues: bool) -> LayerVersion | None:
        """The version of `layer` this call gets: the canary's for a session in its candidate arm, else
        the scope's serving one (a tenant without its own harness gets the global one)."""
        for key in ((layer, tenant), (layer, None)) if layer == HARNESS else ((layer, tenant),):
            scope = self.scopes.get(key)
            if scope is None:
                continue
            c = scope.canary
            if c is not None and c.canary is not None and await self.arm(c.canary, tenant, session_id,
                                                                         continues=continues) == CANDIDATE:
                return c
            if scope.serving is not None:
                return scope.serving
        return None

    async def arm(self, ref: CanaryRef, tenant: str, session_id: str, *, continues: bool) -> str:
        """The session's arm of the canary: remembered, else read or assigned in the database. Without
        the database the serving version serves it, and it is not counted."""
        key = (ref.version_id, tenant, session_id)
        arm = self.arms.get(key)
        if arm is not None:
            return arm
        factory = self.factory
        if factory is None:
            return BEFORE
        try:
            arm = await asyncio.to_thread(assign_now, factory, ref, tenant, session_id, continues=continues)
        except Exception as e:
            log.warning("canary arm of a session not assigned (%s); the serving version serves it", type(e).__name__)
            return BEFORE
        if len(self.arms) >= self.max_arms:  # a cache: a forgotten arm is read back from its row
            self.arms.clear()
        self.arms[key] = arm
        return arm

    def serving_for(self, layer: str, tenant: str) -> LayerVersion | None:
        """The version of `layer` that serves the tenant's sessions outside any canary."""
        for key in ((layer, tenant), (layer, None)) if layer == HARNESS else ((layer, tenant),):
            scope = self.scopes.get(key)
            if scope is not None and scope.serving is not None:
                return scope.serving
        return None

    async def apply(self, body: dict[str, Any], tenant: str, session_id: str, *, continues: bool
                    ) -> tuple[dict[str, Any], Applied]:
        """The body as it goes out, and what was applied. `continues`: the call continues an earlier step
        (a session that began before a canary stays out of it)."""
        return await self.configure(body, tenant, await self.pick(HARNESS, tenant, session_id, continues=continues),
                                    await self.pick(MEMORY, tenant, session_id, continues=continues))

    async def configure(self, body: dict[str, Any], tenant: str, harness: LayerVersion | None,
                        memory: LayerVersion | None) -> tuple[dict[str, Any], Applied]:
        """The body with these versions applied (the replay gate gives both arms' versions). Memory that
        cannot be searched (the database away) sends the call without facts rather than failing it; the
        step then names no memory version."""
        applied = Applied()
        if harness is not None and harness.overlay is not None:
            body, applied.harness = apply_harness(body, harness.overlay), harness
        question = question_text(body) if memory is not None and memory.facts else None
        if memory is not None and question is not None:
            query = query_terms(question)
            try:
                found = await asyncio.to_thread(self._search, tenant, memory, query)
            except Exception as e:
                log.warning("memory %s not searched: %s", memory.name, type(e).__name__)
            else:
                applied.memory, applied.facts = memory, [fid for fid, _ in found]
                body = with_facts(body, [text for _, text in found])
        return body, applied

    def _search(self, tenant: str, memory: LayerVersion, query: list[str]) -> list[tuple[str, str]]:
        """A version that does not serve (a gate's candidate) has its common words read with the search."""
        assert self.factory is not None
        held = self.common.get(memory.id)
        with self.factory() as s:
            return search(s, tenant, memory.facts, query, self.top_k, held[1] if held else None)
