"""Where live calls are offered to a shadow gate (proxy.rollout.layer_shadow holds the gate itself).

A harness or memory candidate in its shadow gate registers a `ShadowRun` here; each call the layers
were applied to is offered to the runs (one dictionary check when none runs). A run takes a call of
its scope that its layer's serving version served (not a canary's arm), a share of them at random,
while it wants more and has room in flight; taking it starts the mirror as a task, so the call itself
waits for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from proxy.layers.serving import Applied, LayerVersion
from proxy.store.layers import HARNESS

log = logging.getLogger("atdp.layers.shadow")

# (the client's body before any layer, the body as served, the tenant, what was applied) -> whether the
# mirror counted (False: the candidate would not have changed the call, or the upstream failed it)
Mirror = Callable[[dict[str, Any], dict[str, Any], str, Applied], Coroutine[Any, Any, bool]]


@dataclass
class ShadowRun:
    candidate: LayerVersion
    share: float
    wanted: int
    concurrency: int
    mirror: Mirror
    taken: int = 0  # mirrors started and not found unchanged
    in_flight: int = 0

    def takes(self, tenant: str, applied: Applied) -> bool:
        c = self.candidate
        if self.taken >= self.wanted or self.in_flight >= self.concurrency:
            return False
        if c.layer == HARNESS:
            served = applied.harness
            # A tenant's own harness hides a global one: a global candidate is measured on the tenants
            # it would serve (no harness, or the global one).
            in_scope = tenant == c.tenant if c.tenant is not None else served is None or served.tenant is None
        else:
            served = applied.memory
            in_scope = tenant == c.tenant
        return in_scope and (served is None or served.canary is None) and random.random() < self.share


@dataclass
class ShadowTap:
    runs: dict[str, ShadowRun] = field(default_factory=dict)  # candidate id -> its run
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def offer(self, body: dict[str, Any], served: dict[str, Any], tenant: str, applied: Applied) -> None:
        """A live call's bodies, before and after its layers; never raises, never waits."""
        for run in list(self.runs.values()):
            if run.takes(tenant, applied):
                run.taken += 1
                run.in_flight += 1
                task = asyncio.create_task(self._mirror(run, body, served, tenant, applied),
                                           name=f"atdp-shadow-{run.candidate.name}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _mirror(self, run: ShadowRun, body: dict[str, Any], served: dict[str, Any], tenant: str,
                      applied: Applied) -> None:
        counted = False
        try:
            counted = await run.mirror(body, served, tenant, applied)
        except Exception:
            log.exception("shadow mirror of %s failed", run.candidate.name)
        finally:
            run.in_flight -= 1
            if not counted:  # another live call may take its place
                run.taken -= 1
