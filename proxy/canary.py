"""Which replicas may serve a call while a canary runs (gate 3; docs/control-plane.md).

The canary's replica group serves the candidate; the other replicas serve the version that was
serving. A session's arm is decided once (proxy.store.canary.assign: a sticky hash of the session id,
or its tenant) and kept in PostgreSQL; here it is cached in memory, so only a session's first call
during the canary (or the first after a restart) reads or writes the database. With no canary
running, `route` answers None at once and calls go anywhere, as always.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from proxy.lru import LRU
from proxy.store.canary import BEFORE, CANDIDATE, CanaryRef, assign_now

log = logging.getLogger("atdp.canary")


@dataclass(frozen=True)
class CanaryRoute:
    arm: str  # candidate | serving | before
    replicas: frozenset[str]  # public labels of the replicas this call may use


class CanaryRouter:
    def __init__(self, factory: Callable[[], Session] | None = None, *, max_sessions: int = 200_000) -> None:
        self.factory = factory
        self.active: CanaryRef | None = None
        self.all_replicas: frozenset[str] = frozenset()
        self._arms: LRU[tuple[str, str], str] = LRU(max_sessions)
        self.changed = asyncio.Event()  # set by every reward posted: the monitor checks at once

    def __len__(self) -> int:
        return len(self._arms)  # sessions whose arm is cached

    def activate(self, ref: CanaryRef, all_replicas: list[str]) -> None:
        """Route by `ref`'s arms. The canary already active is kept as it is (start-up and the swap
        channel may both find it): its monitor follows that object."""
        if self.active is not None and self.active.version_id == ref.version_id:
            return
        self._arms.clear()
        self.all_replicas = frozenset(all_replicas)
        self.active = ref

    def deactivate(self) -> None:
        self.active = None
        self._arms.clear()

    def nudge(self) -> None:
        if self.active is not None:
            self.changed.set()

    def group(self, arm: str) -> frozenset[str]:
        assert self.active is not None
        canary = frozenset(self.active.replicas)
        return canary if arm == CANDIDATE else self.all_replicas - canary

    async def route(self, tenant: str, session_id: str, *, continues: bool) -> CanaryRoute | None:
        """The call's arm and replica group, or None when no canary runs."""
        ref = self.active
        if ref is None:
            return None
        key = (tenant, session_id)
        arm = self._arms.get(key)
        if arm is None:
            arm = await self._assign(ref, tenant, session_id, continues)
            if self.active is not ref:  # the canary ended meanwhile: no group to keep to
                return None
        return CanaryRoute(arm, self.group(arm))

    async def _assign(self, ref: CanaryRef, tenant: str, session_id: str, continues: bool) -> str:
        factory = self.factory
        if factory is None:
            return BEFORE
        try:
            arm = await asyncio.to_thread(assign_now, factory, ref, tenant, session_id, continues=continues)
        except Exception as e:  # no database: the serving version serves it, and it is not counted
            log.warning("canary assignment of a session failed (%s: %s); the serving version serves it",
                        type(e).__name__, e)
            return BEFORE
        self._arms.put((tenant, session_id), arm)
        return arm
