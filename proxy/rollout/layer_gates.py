"""A harness or memory candidate's gates, then its promotion: the policy's gates without a weight load.

candidate -> evaluating -> (replay, safety) -> serving, or -> rejected; the same cases, minimum, scoring
and safety checks as a weight version (proxy.rollout.gates), the same rows and card.

The replay: every case (operator suites, held-out sessions; for a tenant's version only that tenant's)
is answered twice on what serves now (the serving weights, or the provider route the recorded call
went through), once with the serving configuration (the harness and memory versions serving the case's
tenant) and once with the candidate in place of its layer's serving version. Nothing is loaded and no
replica closes: the two arms differ only in the request. Greedy (temperature 0, seed 0), as the policy's.

Promotion moves the row (proxy.store.layers.promote) and this proxy's table of serving versions at once;
other proxies read it within ATDP_LAYERS_REFRESH_S. A version waiting for cases is counted again every
ATDP_EVAL_RECHECK_S, and one a stopped proxy left `evaluating` runs again at start-up.

Gate 3, with the canary on (ATDP_CANARY_FRACTION or ATDP_CANARY_TENANTS): a candidate whose replay and
safety gates pass serves its arm of the new sessions until the sequential test promotes it or rolls it
back (proxy.rollout.layer_canary); a candidate of a layer and scope whose canary runs starts its gates
once that canary is decided.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import select

from atdp_schema.models import GateState, VersionStatus
from proxy import providers
from proxy.evaluation.cases import Answer, EvalCase, EvalSet
from proxy.http import run_db
from proxy.layers.serving import layer_version
from proxy.rollout import layer_canary
from proxy.rollout.gates import (
    GateError,
    GateResult,
    Replay,
    answer_of,
    case_counts,
    collect_cases,
    safety_gate,
    score_gate,
    too_few_cases,
)
from proxy.rollout.layer_shadow import SHADOW_GATE, run_shadow, shadow_on
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.layers import HARNESS, LAYERS, MEMORY, LayerRow, layer_row, promote
from proxy.store.versions import (
    GATES,
    REPLAY_GATE,
    SAFETY_GATE,
    mark_rejected,
    set_gate,
    set_status,
    superseded_by,
)

log = logging.getLogger("atdp.layers.gates")


@dataclass(frozen=True)
class LayerTarget:
    id: str
    name: str
    layer: str
    tenant: str | None


@dataclass
class LayerGates:
    """One evaluation at a time (a FIFO lock), and the running gate tasks by version id."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    canaries: layer_canary.LayerCanaries = field(default_factory=layer_canary.LayerCanaries)

    def start(self, target: LayerTarget, run: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        task = self.tasks.get(target.id)
        if task is None:
            task = asyncio.create_task(run(), name=f"atdp-layer-gates-{target.name}")
            self.tasks[target.id] = task
            task.add_done_callback(lambda _: self.tasks.pop(target.id, None))
        return task


def target_of(row: LayerRow) -> LayerTarget:
    return LayerTarget(row.id, row.name, row.layer, row.tenant)


async def run_layer_gates(state: AppState, lg: LayerGates, target: LayerTarget, *, actor: str) -> None:
    """Evaluate `target`, then promote or reject it (the status is in the database)."""
    gates = (*GATES, SHADOW_GATE) if shadow_on(state) else GATES

    def queue(s) -> None:
        set_status(s, target.id, VersionStatus.evaluating)
        for gate in gates:
            set_gate(s, target.id, gate, GateState.pending)

    await run_db(state, queue)
    await layer_canary.wait_for_scope(state, target.layer, target.tenant, target.id)
    async with lg.lock:
        if newer := await run_db(state, lambda s: superseded_by(s, target.id)):
            reason = f"superseded by {newer}, registered after it and serving now"

            def drop(s) -> None:
                for gate in gates:
                    set_gate(s, target.id, gate, GateState.skipped, {"reason": reason}, finished=True)
                mark_rejected(s, target.id, [reason], actor=actor)

            await run_db(state, drop)
            return

        def begin(s) -> None:
            for gate in GATES:
                set_gate(s, target.id, gate, GateState.running)

        await run_db(state, begin)
        t0 = time.perf_counter()
        results = await _evaluate(state, target)
        results[REPLAY_GATE].numbers["seconds"] = round(time.perf_counter() - t0, 3)
        waiting = results[REPLAY_GATE].state == GateState.pending

        def record(s) -> None:
            for gate, result in results.items():
                set_gate(s, target.id, gate, result.state, result.numbers, finished=not waiting)

        await run_db(state, record)
        if waiting:
            log.info("%s version %s waits for evaluation cases", target.layer, target.name)
            return
        blocking = {g: r for g, r in results.items() if r.state not in (GateState.passed, GateState.skipped)}
        if blocking:
            if shadow_on(state):
                await run_db(state, lambda s: set_gate(s, target.id, SHADOW_GATE, GateState.skipped,
                                                       {"reason": "replay or safety gate did not pass"}, finished=True))
            await _reject(state, target, blocking)
            return
        if not shadow_on(state):
            await _serve(state, lg, target, actor=actor)
            return
    # The shadow gate waits for live calls: outside the lock, so other candidates' gates go on meanwhile.
    if await _shadow(state, target, actor=actor):
        async with lg.lock:
            await _serve(state, lg, target, actor=actor)


async def _serve(state: AppState, lg: LayerGates, target: LayerTarget, *, actor: str) -> None:
    """Gates passed: its canary, or (the canary off) its scope at once."""
    if not await layer_canary.begin(state, lg.canaries, target.id, actor=actor):
        await promote_now(state, target, actor=actor)


async def _reject(state: AppState, target: LayerTarget, blocking: dict[str, GateResult]) -> None:
    reasons = [reason for r in blocking.values() for reason in r.reasons]
    await run_db(state, lambda s: mark_rejected(s, target.id, reasons, actor="gate:" + ",".join(blocking)))
    log.warning("%s version %s rejected: %s", target.layer, target.name, "; ".join(reasons))


async def _shadow(state: AppState, target: LayerTarget, *, actor: str) -> bool:
    """Gate 2b, live calls mirrored (proxy.rollout.layer_shadow). False: the version was rejected, or the
    proxy stops before the gate decided."""
    row = await run_db(state, lambda s: layer_row(s, target.id))
    candidate = layer_version(row) if row is not None else None
    if candidate is None:
        result = GateResult(GateState.error, {}, [f"{target.name} is not a valid {target.layer} version"])
    else:
        log.info("%s version %s mirrors live calls (shadow gate)", target.layer, target.name)
        try:
            outcome = await run_shadow(state, target.id, candidate)
        except Exception as e:
            log.exception("shadow gate of %s could not run", target.name)
            outcome = GateResult(GateState.error, {"error": f"{type(e).__name__}: {e}"},
                                 [f"shadow gate could not run: {type(e).__name__}"])
        if outcome is None:
            return False
        result = outcome
    await run_db(state, lambda s: set_gate(s, target.id, SHADOW_GATE, result.state, result.numbers, finished=True))
    if result.state != GateState.passed:
        await _reject(state, target, {SHADOW_GATE: result})
        return False
    if newer := await run_db(state, lambda s: superseded_by(s, target.id)):  # promoted while this one waited
        await run_db(state, lambda s: mark_rejected(s, target.id, [f"superseded by {newer} during its shadow gate"],
                                                    actor=actor))
        return False
    return True


async def promote_now(state: AppState, target: LayerTarget, *, actor: str) -> None:
    """The canary off: the candidate serves its scope now."""
    await run_db(state, lambda s: promote(s, target.id, actor=actor))
    await asyncio.to_thread(state.layers.reload)
    log.info("%s version %s serves%s", target.layer, target.name, f" tenant {target.tenant}" if target.tenant else "")


async def _evaluate(state: AppState, target: LayerTarget) -> dict[str, GateResult]:
    """Both gates' results; a gate that cannot run fails closed (`error`, the version is rejected)."""
    try:
        replay = await replay_layer(state, target)
    except Exception as e:
        if not isinstance(e, GateError):
            log.exception("replay gate of %s could not run", target.name)
        error = f"{type(e).__name__}: {e}"
        return {REPLAY_GATE: GateResult(GateState.error, {"error": error}, [f"replay evaluation could not run: {error}"]),
                SAFETY_GATE: GateResult(GateState.error, {"error": "no replay answers: " + error},
                                        ["safety checks could not run: no replay answers"])}
    if isinstance(replay, GateResult):
        return {REPLAY_GATE: replay, SAFETY_GATE: GateResult(replay.state, {"reason": "no replay answers"}, [])}
    results = {}
    for gate, judge in ((REPLAY_GATE, score_gate), (SAFETY_GATE, safety_gate)):
        try:
            results[gate] = await asyncio.to_thread(judge, state, replay)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            results[gate] = GateResult(GateState.error, {**replay.counts, "error": error}, [f"{gate} could not run: {error}"])
    return results


async def replay_layer(state: AppState, target: LayerTarget) -> Replay | GateResult:
    evalset = await asyncio.to_thread(collect_cases, state)
    if target.tenant is not None:  # a tenant's version is judged on that tenant's cases only
        evalset = EvalSet(cases=[c for c in evalset.cases if c.tenant == target.tenant], rules=evalset.rules,
                          held_out_sessions=evalset.held_out_sessions, unscored_held_out=evalset.unscored_held_out)
    counts = case_counts(evalset)
    if (early := too_few_cases(state.settings, evalset, counts)) is not None:
        return early
    row = await run_db(state, lambda s: layer_row(s, target.id))
    candidate = layer_version(row) if row is not None else None
    if candidate is None:
        raise GateError(f"{target.name} is not a valid {target.layer} version")
    await asyncio.to_thread(state.layers.reload)  # the serving arm is what serves now
    gate = asyncio.Semaphore(state.settings.eval_concurrency)
    model = await _engine_model(state) if any(_provider(state, c) is None for c in evalset.cases) else None

    async def both(case: EvalCase) -> tuple[Answer, Answer]:
        harness = state.layers.serving_for(HARNESS, case.tenant)
        memory = state.layers.serving_for(MEMORY, case.tenant)
        arms = ((harness, memory), (candidate, memory) if target.layer == HARNESS else (harness, candidate))
        out = []
        for h, m in arms:
            body = {**case.request, "temperature": 0.0, "seed": 0, "stream": False}
            body, _ = await state.layers.configure(body, case.tenant, h, m)
            async with gate:
                out.append(await _answer(state, case, body, model))
        return out[0], out[1]

    pairs = await asyncio.gather(*(both(c) for c in evalset.cases))
    return Replay(evalset, [p[0] for p in pairs], [p[1] for p in pairs], counts)


def _provider(state: AppState, case: EvalCase) -> providers.ProviderRoute | None:
    return state.routes.match(case.model) if case.model else None


async def _engine_model(state: AppState) -> str:
    engine = state.engine_client
    assert engine is not None, "the app is not started"
    replica = next((r for r in state.pool.replicas if r.alive), state.pool.replicas[0])
    resp = await engine.models(replica.url, timeout=30.0)
    data = resp.json().get("data") if resp.status == 200 else None
    if not data:
        raise GateError(f"{replica.label} /v1/models answered {resp.status}: no model to evaluate")
    return data[0]["id"]


async def _answer(state: AppState, case: EvalCase, body: dict[str, Any], model: str | None) -> Answer:
    """One case's answer from what serves it: its provider route, else an engine replica."""
    route = _provider(state, case)
    if route is not None:
        resp = await providers.open_provider(route, {**body, "model": case.model})
        try:
            data = await resp.aread()
        finally:
            await resp.aclose()
        if resp.status_code >= 400:
            raise GateError(f"case {case.id}: the provider answered {resp.status_code}")
        return answer_of(orjson.loads(data))
    engine = state.engine_client
    assert engine is not None and model is not None
    replica = next((r for r in state.pool.replicas if r.alive), state.pool.replicas[0])
    resp = await engine.chat(replica.url, {**body, "model": model}, timeout=state.settings.upstream_timeout_s)
    if resp.status >= 400:
        raise GateError(f"case {case.id}: the engine answered {resp.status}: {resp.text[:300]}")
    return answer_of(resp.json())


async def recheck_layers(state: AppState, lg: LayerGates) -> None:
    """At start-up, then every ATDP_EVAL_RECHECK_S: run the gates of every harness and memory candidate
    left `evaluating` (a stopped proxy's, or one waiting for cases) that no task here is running."""
    first = True
    while not state.stopping.is_set():
        if not first:
            await asyncio.sleep(state.settings.eval_recheck_s)
        first = False
        if state.factory is None:
            await asyncio.sleep(1.0)
            first = True
            continue

        def waiting(s) -> list[LayerTarget]:
            rows = s.scalars(select(t.ModelVersion).where(t.ModelVersion.layer.in_(LAYERS),
                                                          t.ModelVersion.status == VersionStatus.evaluating)
                             .order_by(t.ModelVersion.created_at)).all()
            return [LayerTarget(v.id, v.name, v.layer, v.tenant_id) for v in rows]

        try:
            targets = await run_db(state, waiting)
            await layer_canary.resume(state, lg.canaries)
        except Exception as e:
            log.warning("could not look for harness and memory candidates to evaluate: %s", type(e).__name__)
            continue
        for target in targets:
            if target.id not in lg.tasks:
                lg.start(target, lambda target=target: run_layer_gates(state, lg, target, actor="system:recheck"))

