"""Gate 3 for a harness or memory candidate: a per-session canary, with no replica of its own.

A harness or memory version changes the request, not the weights, so its canary needs no replica group:
the proxy applies the candidate to its arm of the new sessions (proxy.layers.serving picks per call) and
the serving version to the rest, on one engine or on a provider route alike. The rows, the sticky
assignment, the arms' numbers and the sequential decision are a weight version's canary's
(proxy.store.canary, proxy.rollout.canary.evaluate): the same settings (ATDP_CANARY_FRACTION or
ATDP_CANARY_TENANTS, the margins, ATDP_CANARY_CHECK_S), the same `canary` gate numbers on the card.

- `begin`: the candidate's replay and safety gates passed; with the canary on it becomes `canary`
  against the version of its layer serving its scope (or none), and every proxy applies it to its arm
  within ATDP_LAYERS_REFRESH_S. Off: the caller promotes it.
- `monitor`: every ATDP_CANARY_CHECK_S, both arms from the store, the decision, the numbers on the gate.
- `conclude`: promote (it serves the scope, the one before it is `retired`) or roll back (it is
  `rolled_back`; its arm goes back to the serving version). Decided once, under the canary row's lock,
  whichever proxy's monitor gets there first.
- One canary per layer and scope: a later candidate of the same layer and scope starts its gates once
  the canary is decided (its replay then compares with what serves after it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from atdp_schema.models import GateState, VersionStatus
from proxy.http import run_db
from proxy.rollout.canary import CANARY_GATE, canary_on, evaluate, live_numbers, margins_of, tenants_of
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.canary import CanaryRef, canary_of, finish_canary, mark_rolled_back, start_canary
from proxy.store.layers import layer_canaries, promote, serving_layer
from proxy.store.versions import REPLAY_GATE, set_gate, set_status

log = logging.getLogger("atdp.layers.canary")
WHERE = "per session, sticky, on what serves the calls (no replica of its own)"


@dataclass
class LayerCanaries:
    """The monitors this proxy runs, by version id."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def watch(self, state: AppState, ref: CanaryRef) -> None:
        if ref.version_id in self.tasks:
            return
        task = asyncio.get_running_loop().create_task(monitor(state, ref), name=f"layer-canary:{ref.candidate}")
        self.tasks[ref.version_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(ref.version_id, None))


async def begin(state: AppState, canaries: LayerCanaries, version_id: str, *, actor: str) -> bool:
    """Start the candidate's canary; False (nothing done) when the canary is off."""
    if not canary_on(state):
        return False
    settings, tenants, margins = state.settings, tenants_of(state), margins_of(state)
    plan = {"fraction": settings.canary_fraction, "tenants": tenants, "margins": asdict(margins), "where": WHERE}

    def record(s: Session) -> CanaryRef:
        v = s.get(t.ModelVersion, version_id)
        assert v is not None
        serving = serving_layer(s, v.layer, v.tenant_id)
        ref = start_canary(s, version_id=v.id, serving_id=serving.id if serving else None,
                           fraction=settings.canary_fraction, tenants=tenants, replicas=[], margins=asdict(margins))
        set_status(s, v.id, VersionStatus.canary)
        set_gate(s, v.id, CANARY_GATE, GateState.running, {**plan, "serving": ref.serving})
        s.add(t.AuditEvent(actor=actor, action="version.canary", target=v.id,
                           details={**plan, "layer": v.layer, "scope": v.tenant_id, "serving": ref.serving}))
        return ref

    ref = await run_db(state, record)
    await asyncio.to_thread(state.layers.reload)
    canaries.watch(state, ref)
    log.info("canary of %s against %s (%.0f%% of new sessions%s)", ref.candidate, ref.serving,
             100 * settings.canary_fraction, f", tenants {tenants}" if tenants else "")
    return True


async def wait_for_scope(state: AppState, layer: str, tenant: str | None, version_id: str) -> None:
    """Return once no other version of this layer and scope is in its canary."""
    scope = t.ModelVersion.tenant_id.is_(None) if tenant is None else t.ModelVersion.tenant_id == tenant

    def running(s: Session) -> str | None:
        return s.scalar(select(t.ModelVersion.name).where(
            t.ModelVersion.layer == layer, scope, t.ModelVersion.id != version_id,
            t.ModelVersion.status == VersionStatus.canary).limit(1))

    told = None
    while (other := await run_db(state, running)) is not None:
        if other != told:  # the card says what it waits for
            reason = f"waits for the canary of {other} (one canary per layer and scope)"
            await run_db(state, lambda s, r=reason: set_gate(s, version_id, REPLAY_GATE, GateState.pending,
                                                             {"reason": r}))
            log.info("%s candidate %s", layer, reason)
            told = other
        await asyncio.sleep(state.settings.canary_check_s)


async def monitor(state: AppState, ref: CanaryRef) -> None:
    seen = -1
    while not state.stopping.is_set():
        await asyncio.sleep(state.settings.canary_check_s)
        try:
            def check(s: Session) -> tuple[str, list[str], dict[str, Any]] | None:
                if canary_of(s, ref.version_id) is None:  # decided (another proxy, an operator's rollback)
                    return None
                return evaluate(s, state, ref)

            found = await run_db(state, check)
            if found is None:
                await asyncio.to_thread(state.layers.reload)
                return
            verdict, reasons, numbers = found
            numbers = {**numbers, "where": WHERE}
            if verdict != "continue":
                await conclude(state, ref, verdict, reasons, numbers, actor="gate:" + CANARY_GATE)
                return
            if numbers["observations"] != seen:  # live numbers on the gate and the card
                await run_db(state, lambda s, n=numbers: live_numbers(s, ref, n))
                seen = numbers["observations"]
        except Exception as e:  # the database away: try again at the next check
            log.warning("canary check of %s failed (%s); retrying", ref.candidate, type(e).__name__)


async def conclude(state: AppState, ref: CanaryRef, verdict: str, reasons: list[str], numbers: dict[str, Any], *,
                   actor: str) -> str | None:
    """Promote or roll back; None when the canary was decided already."""
    def write(s: Session) -> str | None:
        row = s.get(t.Canary, ref.version_id, with_for_update=True, populate_existing=True)
        if row is None or row.decided_at is not None:
            return None
        if verdict == "promote":
            promote(s, ref.version_id, actor=actor)
            set_gate(s, ref.version_id, CANARY_GATE, GateState.passed, numbers, finished=True)
            finish_canary(s, ref.version_id, "promoted", numbers)
            return "promoted"
        mark_rolled_back(s, ref.version_id, reasons, actor=actor)
        set_gate(s, ref.version_id, CANARY_GATE, GateState.failed, numbers, finished=True)
        finish_canary(s, ref.version_id, "rolled_back", numbers)
        return "rolled_back"

    decision = await run_db(state, write)
    await asyncio.to_thread(state.layers.reload)
    if decision is not None:
        log.log(logging.INFO if decision == "promoted" else logging.WARNING, "canary of %s %s: %s", ref.candidate,
                decision, "; ".join(reasons))
    return decision


async def rollback_now(state: AppState, version_id: str, *, actor: str) -> str | None:
    """An operator's rollback of a harness or memory version in its canary; None: it is in none."""
    def numbers(s: Session) -> tuple[CanaryRef, dict[str, Any]] | None:
        ref = canary_of(s, version_id)
        return None if ref is None else (ref, {**evaluate(s, state, ref)[2], "where": WHERE})

    found = await run_db(state, numbers)
    if found is None:
        return None
    ref, n = found
    reasons = [f"operator rollback ({actor})"]
    return await conclude(state, ref, "rollback", reasons, {**n, "verdict": "rollback", "reasons": reasons},
                          actor=actor)


async def resume(state: AppState, canaries: LayerCanaries) -> None:
    """Monitor every harness and memory canary recorded in PostgreSQL that no task here watches (at
    start-up, and with each recheck: one another proxy began goes on if that proxy goes away)."""
    rows = await run_db(state, layer_canaries)
    for row in rows:
        if row.canary is not None:
            canaries.watch(state, row.canary)

