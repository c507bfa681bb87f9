"""Gate 3: the canary. After its other gates pass, a candidate serves a share of new sessions on its
own replica group while the serving version serves the rest; a sequential test decides, after every
rewarded session, to promote it (every replica) or to roll it back (its group gets the serving
weights back). docs/control-plane.md has the rules and the formula.

- `begin`: swap the group (`canary_replicas` replicas; the others keep serving) to the candidate, write
  the canary row, open the routing (proxy.canary), start the monitor. With the canary off (no
  fraction, no tenants) it does nothing and the caller promotes as before; with too few replicas
  for two groups the `canary` gate is `skipped` (its numbers say why) and the caller promotes.
- `monitor`: wakes on every reward posted (and every `canary_check_s`), reads both arms from the store
  (proxy.store.canary), runs proxy.evaluation.sequential.decide, records the numbers on the gate.
- `conclude`: promote (swap the other replicas, the candidate serves) or roll back (swap the group
  back; the candidate is `rolled_back`, its steps released). The routing closes first, so calls
  never wait on a group that is leaving; in-flight calls drain before any replica reloads.
- `resume`: after a restart, the canary recorded in PostgreSQL goes on (proxy.rollout.swap's start-up
  has stamped the group's replicas and reopened the routing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import asdict
from typing import Any

from sqlalchemy.orm import Session

from atdp_schema.models import GateState, VersionStatus
from proxy.evaluation.sequential import Margins, Observation, decide, radius
from proxy.http import run_db
from proxy.rollout import canarybus
from proxy.rollout.swap import Versions
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.canary import (
    CanaryRef,
    arm_metrics,
    finish_canary,
    mark_rolled_back,
    rewards_in_order,
    start_canary,
    step_outcomes,
    tool_outcomes,
)
from proxy.store.versions import VersionRef, mark_failed, record_swap, set_gate, set_status

log = logging.getLogger("atdp.canary")
CANARY_GATE = "canary"
RULE = ("promote when the time-uniform lower bound of candidate - serving reward >= -promote_margin; roll back "
        "when its upper bound < -reward_drop, or an error / tool-failure rate rise above its margin is shown")
SwapOutcome = dict[str, Any]


def margins_of(state: AppState) -> Margins:
    s = state.settings
    return Margins(alpha=s.canary_alpha, promote_margin=s.canary_promote_margin, reward_drop=s.canary_reward_drop,
                   error_rise=s.canary_error_rise, tool_failure_rise=s.canary_tool_failure_rise)


def tenants_of(state: AppState) -> list[str]:
    return [x.strip() for x in state.settings.canary_tenants.split(",") if x.strip()]


def canary_on(state: AppState) -> bool:
    """A share of new sessions, or named tenants, go to a candidate before it serves everyone."""
    return state.settings.canary_fraction > 0 or bool(tenants_of(state))


async def begin(state: AppState, versions: Versions, target: VersionRef, *, actor: str) -> SwapOutcome | None:
    """Start the candidate's canary (called with `versions.lock` held, its other gates passed). Returns the
    group's swap outcome, or None when no canary runs (the caller promotes to every replica)."""
    settings, pool = state.settings, state.pool
    if not canary_on(state):
        return None
    tenants = tenants_of(state)
    margins = margins_of(state)
    plan = {"fraction": settings.canary_fraction, "tenants": tenants, "margins": asdict(margins)}
    k = settings.canary_replicas
    if len(pool.replicas) <= k:
        reason = (f"a canary needs more replicas than its group of {k} (there are {len(pool.replicas)}): "
                  "promoted without one")
        await run_db(state, lambda s: set_gate(s, target.id, CANARY_GATE, GateState.skipped,
                                               {**plan, "reason": reason}, finished=True))
        log.warning("version %s: %s", target.name, reason)
        return None
    serving = versions.current
    assert serving is not None, "gates run only once the serving version is known"
    group = pool.replicas[:k]
    outcome = await versions.swap(target, group, becomes_current=False)
    if not outcome["ok"]:
        await run_db(state, lambda s: (set_gate(s, target.id, CANARY_GATE, GateState.error,
                                                {**plan, "error": outcome["error"]}, finished=True),
                                       mark_failed(s, target.id, outcome["error"], actor=actor)))
        return outcome
    labels = [r.label for r in group]

    def record(s: Session) -> CanaryRef:
        ref = start_canary(s, version_id=target.id, serving_id=serving.id, fraction=settings.canary_fraction,
                           tenants=tenants, replicas=labels, margins=asdict(margins))
        set_status(s, target.id, VersionStatus.canary)
        set_gate(s, target.id, CANARY_GATE, GateState.running, {**plan, "replicas": labels, "serving": serving.name})
        s.add(t.AuditEvent(actor=actor, action="version.canary", target=target.id,
                           details={**plan, "replicas": labels, "serving": serving.name,
                                    "seconds": round(outcome["seconds"], 4)}))
        return ref

    ref = await run_db(state, record)
    state.canary.activate(ref, [r.label for r in pool.replicas])
    start_monitor(state, versions, ref)
    await canarybus.announce(versions, ref.version_id, active=True)  # every proxy routes by its arms
    log.info("canary of %s against %s on %s (%.0f%% of new sessions%s)", target.name, serving.name,
             ", ".join(labels), 100 * settings.canary_fraction, f", tenants {tenants}" if tenants else "")
    return outcome


def start_monitor(state: AppState, versions: Versions, ref: CanaryRef) -> None:
    versions.canary_task = asyncio.get_running_loop().create_task(monitor(state, versions, ref),
                                                                  name=f"canary:{ref.candidate}")


async def resume(state: AppState, versions: Versions) -> None:
    """At start-up: once the versions are loaded, the canary that was running then goes on being
    monitored, unless the swap channel's listener started a monitor of it first (one canary at a
    time; proxy.rollout.canarybus.sync monitors a canary heard of there)."""
    while not versions.ready.is_set():  # polled: a thread blocked on the event would outlive shutdown
        await asyncio.sleep(0.5)
    ref, found = state.canary.active, versions.canary_at_start
    if ref is not None and found is not None and ref.version_id == found.version_id and versions.canary_task is None:
        start_monitor(state, versions, ref)


async def wait_for_canary(versions: Versions) -> None:
    """A candidate's gates start only once a running canary is decided (one canary at a time)."""
    task = versions.canary_task
    if task is not None and not task.done():
        await asyncio.shield(task)


async def monitor(state: AppState, versions: Versions, ref: CanaryRef) -> None:
    """Decide the canary; with several proxies on the database, only while holding the monitor lock
    (the others wait for it, and take over if its holder goes away)."""
    async with canarybus.sole_monitor(versions, lambda: state.canary.active is ref,
                                      state.settings.canary_check_s) as mine:
        if mine:
            await _decide(state, versions, ref)


async def _decide(state: AppState, versions: Versions, ref: CanaryRef) -> None:
    seen = -1
    while state.canary.active is ref:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.canary.changed.wait(), state.settings.canary_check_s)
        state.canary.changed.clear()
        if state.canary.active is not ref:
            return
        try:
            verdict, reasons, numbers = await run_db(state, lambda s: evaluate(s, state, ref))
            count = numbers["observations"]
            if verdict != "continue":
                await conclude(state, versions, ref, verdict, reasons, numbers, actor="gate:" + CANARY_GATE)
                return
            if count != seen:  # live numbers on the gate (GET /atdp/v1/versions/{id}, the card)
                await run_db(state, lambda s, n=numbers: live_numbers(s, ref, n))
                seen = count
        except Exception:
            log.exception("canary check of %s failed; retrying", ref.candidate)
            await asyncio.sleep(state.settings.canary_check_s)


def live_numbers(s: Session, ref: CanaryRef, numbers: dict[str, Any]) -> None:
    """The canary's numbers so far on its gate, unless it was decided since they were read: a rollback
    (an operator's, or another proxy's monitor) must not be written over with `running`."""
    row = s.get(t.Canary, ref.version_id, with_for_update=True, populate_existing=True)
    if row is not None and row.decided_at is None:
        set_gate(s, ref.version_id, CANARY_GATE, GateState.running, numbers)


def evaluate(s: Session, state: AppState, ref: CanaryRef) -> tuple[str, list[str], dict[str, Any]]:
    """Both arms from the store, the sequential decision, and the numbers the gate shows."""
    margins = margins_of(state)
    ranges: dict[str, tuple[float, float]] = {}

    def scaled(tenant: str, r: float) -> float:  # the tenant's reward range onto [0, 1]
        if tenant not in ranges:
            p = state.policies.policy_for(s, tenant)
            ranges[tenant] = (p.reward_min, p.reward_max)
        lo, hi = ranges[tenant]
        return min(1.0, max(0.0, (r - lo) / (hi - lo)))

    rewards = [Observation(arm, scaled(tenant, r)) for arm, tenant, r in rewards_in_order(s, ref.version_id)]
    errors = [Observation(arm, x) for arm, x in step_outcomes(s, ref.version_id)]
    tools = [Observation(arm, x) for arm, x in tool_outcomes(s, ref.version_id)]
    d = decide(rewards, errors, tools, margins)
    arms = arm_metrics(s, ref.version_id)
    for arm in ("candidate", "serving"):  # each arm's reward mean and its time-uniform interval
        xs = [o.value for o in rewards if o.arm == arm]
        mean = sum(xs) / len(xs) if xs else None
        r = radius(len(xs), margins.alpha / 2)
        arms.setdefault(arm, {})["reward"] = {
            "n": len(xs), "mean": None if mean is None else round(mean, 4),
            "low": None if mean is None else round(max(0.0, mean - r), 4),
            "high": None if mean is None else round(min(1.0, mean + r), 4)}
        arms[arm]["tool_failure_rate"] = _rate(tools, arm)
    numbers = {
        "candidate": ref.candidate, "serving": ref.serving, "fraction": ref.fraction, "tenants": list(ref.tenants),
        "replicas": list(ref.replicas), "margins": asdict(margins), "observations": len(rewards),
        "reward_scale": "each tenant's [reward_min, reward_max] mapped to [0, 1]",
        "arms": arms, "difference": {"reward": d.reward.as_dict(), "error_rate": d.errors.as_dict(),
                                     "tool_failure_rate": d.tool_failures.as_dict()},
        "verdict": d.verdict, "reasons": d.reasons, "decided_at_observation": d.at_reward if d.verdict != "continue"
        else None, "rule": RULE, "test": "Hoeffding normal-mixture confidence sequence (time-uniform)",
    }
    return d.verdict, d.reasons, _finite(numbers)


def _rate(obs: list[Observation], arm: str) -> float | None:
    xs = [o.value for o in obs if o.arm == arm]
    return round(sum(xs) / len(xs), 4) if xs else None


def _finite(x: Any) -> Any:
    """JSON has no infinities: an unbounded side is null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


async def conclude(state: AppState, versions: Versions, ref: CanaryRef, verdict: str, reasons: list[str],
                   numbers: dict[str, Any], *, actor: str) -> SwapOutcome:
    """Promote or roll back. The routing closes first: from then on calls go to any open replica, and a
    replica reloads only once its in-flight calls have drained (no call fails)."""
    pool = state.pool
    async with versions.lock:
        if state.canary.active is not ref:
            return {"ok": False, "error": "the canary was already decided", "seconds": 0.0, "replicas": []}

        def refs(s: Session) -> tuple[VersionRef, VersionRef]:
            c, v = s.get(t.ModelVersion, ref.version_id), s.get(t.ModelVersion, ref.serving_id)
            return VersionRef(c.id, c.name, c.checkpoint), VersionRef(v.id, v.name, v.checkpoint)

        target, serving = await run_db(state, refs)
        state.canary.deactivate()
        await canarybus.announce(versions, ref.version_id, active=False)  # before any replica reloads
        group = [r for r in pool.replicas if r.label in ref.replicas]
        if verdict == "promote":
            rest = [r for r in pool.replicas if r.label not in ref.replicas]
            outcome = await versions.swap(target, rest, previous=serving)
            numbers = {**numbers, "promotion": {k: outcome.get(k) for k in ("ok", "error", "seconds", "replicas")}}
            if outcome["ok"]:
                def promoted(s: Session) -> None:
                    record_swap(s, target, outcome, actor=actor, left_status=VersionStatus.retired, candidate=False)
                    set_gate(s, target.id, CANARY_GATE, GateState.passed, numbers, finished=True)
                    finish_canary(s, target.id, "promoted", numbers)

                await run_db(state, promoted)
                log.info("canary of %s promoted: %s", target.name, "; ".join(reasons))
                return outcome
            # The other replicas kept the serving version; take the group back to it too.
            reasons = [f"promotion failed: {outcome['error']}"]
        back = await versions.swap(serving, group, previous=serving, becomes_current=False)
        numbers = {**numbers, "rollback": {k: back.get(k) for k in ("ok", "error", "seconds", "replicas")}}

        def rolled_back(s: Session) -> None:
            mark_rolled_back(s, target.id, reasons, actor=actor)
            set_gate(s, target.id, CANARY_GATE, GateState.failed, numbers, finished=True)
            finish_canary(s, target.id, "rolled_back", numbers)

        await run_db(state, rolled_back)
        log.warning("canary of %s rolled back: %s", target.name, "; ".join(reasons))
        return back


async def rollback_now(state: AppState, versions: Versions, version_id: str, *, actor: str) -> SwapOutcome | None:
    """An operator's rollback of a running canary (POST .../rollback on a `canary` version)."""
    ref = state.canary.active
    if ref is None or ref.version_id != version_id:
        return None
    _, _, numbers = await run_db(state, lambda s: evaluate(s, state, ref))
    return await conclude(state, versions, ref, "rollback", [f"operator rollback ({actor})"], numbers, actor=actor)
