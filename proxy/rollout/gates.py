"""A candidate's gates, run in the background after `POST /atdp/v1/versions`, then its promotion.

candidate -> evaluating -> (gates) -> canary (proxy.rollout.canary, when it is on) or serving, or ->
rejected. With the canary off a candidate whose gates pass is promoted to every replica directly.

Gate 1, replay evaluation (`replay_eval`): the evaluation set (proxy.evaluation.cases: operator suites
and the tenants' held-out sessions) is replayed greedily (temperature 0) on one replica, first with
the serving weights, then with the candidate's, loaded with the swap machinery; the serving weights
are loaded back before the replica reopens. Scores come from the evaluators (proxy.evaluation
.evaluators), the verdict from proxy.evaluation.stats.
- fewer cases than `ATDP_EVAL_MIN_CASES` (20): the candidate waits, `evaluating` with both gates
  `pending` and the numbers saying how many cases there are and how many it needs; `recheck_waiting`
  counts again every `ATDP_EVAL_RECHECK_S` and runs its gates once there are enough. The cases come
  from the default held-out share (10% of sessions, never trained on, scored against the rewarded
  recorded answers: proxy.evaluation.cases) and any operator suite, so a fresh install's first
  candidate is evaluated once enough rewarded sessions are held out, never served unevaluated;
- `ATDP_GATES=off` (explicit): no minimum; a candidate with no case at all is promoted with the gate
  `skipped`, the reason naming the setting (the card shows it);
- the candidate's weights do not load: the version is `failed` (as a failed swap);
- an evaluator or a suite is broken: the gate is `error` and the version `rejected` (fail closed).

Gate 2, safety (`safety`): the same answers of both versions, checked per tenant by
proxy.evaluation.safety (secrets and PII the redaction engine detects, the tenant policy's forbidden
and refusal patterns). It runs whenever the replay gate has answers (also when the replay gate failed,
so the card shows both); `skipped` with it. A version is rejected when either gate is not passed.

While the candidate is loaded, that replica's gate is closed: other replicas serve, and on a
single-replica install calls wait for it (up to ATDP_SWAP_HOLD_TIMEOUT_S), like during a swap.

A candidate is `evaluating` from the moment its gates are asked for (also while it waits for another
candidate's gates), so a proxy that stops leaves it `evaluating`; `resume_gates` runs its gates again
when the proxy starts (the engine got the serving weights back at start-up, proxy.rollout.swap).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from atdp_schema.models import GateState, VersionStatus
from proxy.config import Settings
from proxy.engine import EngineClient
from proxy.evaluation import safety
from proxy.evaluation.cases import Answer, EvalCase, EvalSet, SuiteError, add_held_out, load_suites
from proxy.evaluation.evaluators import EvaluatorError, Registry
from proxy.evaluation.stats import RESAMPLES, SEED, Pair, decide
from proxy.http import run_db
from proxy.rollout.canary import begin as begin_canary
from proxy.rollout.canary import wait_for_canary
from proxy.rollout.engine_weights import load_weights
from proxy.rollout.swap import Versions
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.versions import (
    GATES,
    POLICY,
    REPLAY_GATE,
    SAFETY_GATE,
    VersionRef,
    mark_failed,
    mark_rejected,
    record_swap,
    set_gate,
    set_status,
    superseded_by,
)
from proxy.upstream import Replica

log = logging.getLogger("atdp.gates")
SwapOutcome = dict[str, Any]  # Versions.swap's answer: ok, error, seconds, replicas


class GateError(Exception):
    """The gate could not run (engine, evaluator or suite trouble)."""


@dataclass
class GateResult:
    state: str  # GateState
    numbers: dict
    reasons: list[str]


async def run_gates(state: AppState, versions: Versions, target: VersionRef, *, actor: str) -> SwapOutcome | None:
    """Evaluate `target`, then promote or reject it. Returns the promotion's swap outcome (None: no swap);
    the version's status is in the database."""
    def queue(s) -> None:  # before the lock: a restart finds it even while it waits for another's gates
        set_status(s, target.id, VersionStatus.evaluating)
        for gate in GATES:
            set_gate(s, target.id, gate, GateState.pending)

    # Candidates are evaluated in the order their gates were started: the lock (FIFO) is this task's
    # first wait, so the status write runs beside it rather than before it.
    queued = asyncio.create_task(run_db(state, queue))
    await wait_for_canary(versions)  # one canary at a time: a running one is decided first
    async with versions.lock:
        await queued
        if newer := await run_db(state, lambda s: superseded_by(s, target.id)):
            # It waited for cases while a later candidate passed its gates and took over: out of date.
            reason = f"superseded by {newer}, registered after it and serving now"

            def drop(s) -> None:
                for gate in GATES:
                    set_gate(s, target.id, gate, GateState.skipped, {"reason": reason}, finished=True)
                mark_rejected(s, target.id, [reason], actor=actor)

            await run_db(state, drop)
            log.info("version %s not evaluated: %s", target.name, reason)
            return None

        def begin(s) -> None:
            for gate in GATES:
                set_gate(s, target.id, gate, GateState.running)

        await run_db(state, begin)
        t0 = time.perf_counter()
        try:
            results = await _evaluate(state, versions, target)
        except _CandidateLoadError as e:
            error = f"candidate weights did not load: {e}"

            def failed(s) -> None:
                for gate in GATES:
                    set_gate(s, target.id, gate, GateState.error, {"error": error}, finished=True)
                mark_failed(s, target.id, error, actor=actor)

            await run_db(state, failed)
            return None
        results[REPLAY_GATE].numbers["seconds"] = round(time.perf_counter() - t0, 3)

        waiting = results[REPLAY_GATE].state == GateState.pending

        def record(s) -> None:
            for gate, result in results.items():
                set_gate(s, target.id, gate, result.state, result.numbers, finished=not waiting)

        await run_db(state, record)
        if waiting:  # stays `evaluating`; recheck_waiting runs its gates again once there are cases
            log.info("version %s waits for evaluation cases: %s", target.name, results[REPLAY_GATE].numbers["reason"])
            return None
        blocking = {gate: r for gate, r in results.items() if r.state not in (GateState.passed, GateState.skipped)}
        if blocking:
            reasons = [reason for r in blocking.values() for reason in r.reasons]
            await run_db(state, lambda s: mark_rejected(s, target.id, reasons, actor="gate:" + ",".join(blocking)))
            log.warning("version %s rejected: %s", target.name, "; ".join(reasons))
            return None
        # Passed (or nothing to evaluate on): the canary (gate 3), when it is on; else every replica now.
        canary = await begin_canary(state, versions, target, actor=actor)
        if canary is not None:
            return canary
        outcome = await versions.swap(target)
        await run_db(state, lambda s: record_swap(s, target, outcome, actor=actor, left_status=VersionStatus.retired,
                                                  candidate=True))
        return outcome


async def _evaluate(state: AppState, versions: Versions, target: VersionRef) -> dict[str, GateResult]:
    """Both gates' results. Fail closed: a gate that cannot run does not let the version through."""
    try:
        replay = await replay_gate(state, versions, target)
    except _CandidateLoadError:
        raise
    except Exception as e:
        log.exception("replay gate of %s could not run", target.name)
        error = f"{type(e).__name__}: {e}"
        return {REPLAY_GATE: GateResult(GateState.error, {"error": error}, [f"replay evaluation could not run: {error}"]),
                SAFETY_GATE: GateResult(GateState.error, {"error": "no replay answers: " + error},
                                        ["safety checks could not run: no replay answers"])}
    if isinstance(replay, GateResult):  # nothing to evaluate on (yet, when it waits for cases)
        return {REPLAY_GATE: replay, SAFETY_GATE: GateResult(replay.state, {"reason": "no replay answers"}, [])}
    results = {}
    for gate, judge in ((REPLAY_GATE, score_gate), (SAFETY_GATE, safety_gate)):
        try:
            results[gate] = await asyncio.to_thread(judge, state, replay)
        except Exception as e:
            if not isinstance(e, GateError):
                log.exception("gate %s of %s could not run", gate, target.name)
            error = f"{type(e).__name__}: {e}"
            results[gate] = GateResult(GateState.error, {**replay.counts, "error": error}, [f"{gate} could not run: {error}"])
    return results


class _CandidateLoadError(Exception):
    pass


@dataclass(frozen=True)
class Replay:
    """Both versions' answers to the evaluation set, in the cases' order."""

    evalset: EvalSet
    serving: list[Answer]
    candidate: list[Answer]
    counts: dict[str, int]


async def replay_gate(state: AppState, versions: Versions, target: VersionRef) -> Replay | GateResult:
    """The replay: both versions' answers, or a `skipped` result when there is nothing to evaluate."""
    settings = state.settings
    evalset = await asyncio.to_thread(collect_cases, state)
    counts = case_counts(evalset)
    if (early := too_few_cases(settings, evalset, counts)) is not None:
        return early
    serving = versions.current
    if serving is None:
        raise GateError("the serving version is not known yet")
    pool, engine = state.pool, state.engine_client
    assert engine is not None, "the app is not started"
    replica = next((r for r in pool.replicas if r.alive), pool.replicas[0])
    model = await _model_name(engine, replica)
    timeout = settings.upstream_timeout_s
    # The serving weights answer first, with the replica open (its weights do not change).
    base_answers = await _answers(engine, replica, model, evalset.cases, timeout, settings.eval_concurrency)
    async with versions.driving(), versions.closed(replica):  # every proxy's gate, when several share the database
        try:
            await load_weights(engine, replica, target.checkpoint, target.name, timeout_s=versions.load_timeout_s)
        except Exception as e:
            await versions.restore(replica, serving)
            raise _CandidateLoadError(f"{type(e).__name__}: {e}") from e
        try:
            cand_answers = await _answers(engine, replica, model, evalset.cases, timeout, settings.eval_concurrency)
        finally:
            await versions.restore(replica, serving)  # reopen only with the serving weights back
    return Replay(evalset, base_answers, cand_answers, counts)


def case_counts(evalset: EvalSet) -> dict[str, int]:
    return {"suite_cases": sum(c.source.startswith("suite:") for c in evalset.cases),
            "held_out_cases": sum(c.source.startswith("held-out:") for c in evalset.cases),
            "held_out_sessions": evalset.held_out_sessions, "unscored_held_out_steps": evalset.unscored_held_out}


def too_few_cases(settings: Settings, evalset: EvalSet, counts: dict[str, int]) -> GateResult | None:
    """`skipped` (gates off, no case at all) or `pending` (gates on, fewer than the minimum), else None."""
    if settings.gates == "off" and not evalset.cases:
        return GateResult(GateState.skipped, {**counts, "gates": "off", "reason": "no evaluation cases, and gates are "
                                              "off by setting (ATDP_GATES=off): promoted unevaluated"}, [])
    if settings.gates == "on" and len(evalset.cases) < settings.eval_min_cases:
        return GateResult(GateState.pending, {**counts, "cases": len(evalset.cases), "needs": settings.eval_min_cases,
                                              "reason": f"waiting for evaluation cases: {len(evalset.cases)} of "
                                              f"{settings.eval_min_cases} (held-out rewarded sessions, operator "
                                              "suites); counted again every ATDP_EVAL_RECHECK_S"}, [])
    return None


def answer_of(data: dict[str, Any]) -> Answer:
    """A chat completion's first choice as the evaluators read it."""
    choice = data["choices"][0]
    message = choice["message"]
    calls = [{"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
             for c in message.get("tool_calls") or []]
    return Answer(text=message.get("content") or "", tool_calls=calls, finish_reason=choice.get("finish_reason"))


def collect_cases(state: AppState) -> EvalSet:
    settings = state.settings
    try:
        evalset = load_suites(settings.eval_suites, max_tokens=settings.eval_max_tokens)
    except (SuiteError, OSError) as e:
        raise GateError(f"operator suites ({settings.eval_suites}): {e}") from e
    evalset.cases = evalset.cases[: settings.eval_max_cases]
    assert state.factory is not None, "the database is not connected"
    with state.factory() as s:
        holdout = state.policies.holdout_shares(s)
        if holdout[1] > 0 or any(v > 0 for v in holdout[0].values()):
            def well_rewarded(tenant: str, mean: float) -> bool:  # above the middle of the tenant's range
                policy = state.policies.policy_for(s, tenant)
                return mean > (policy.reward_min + policy.reward_max) / 2

            add_held_out(s, evalset, holdout, max_cases=settings.eval_max_cases, max_tokens=settings.eval_max_tokens,
                         well_rewarded=well_rewarded)
    return evalset


def score_gate(state: AppState, replay: Replay) -> GateResult:
    evalset, base, cand, counts = replay.evalset, replay.serving, replay.candidate, replay.counts
    registry = Registry()
    pairs: list[Pair] = []
    regressions: list[dict] = []
    for case, b, c in zip(evalset.cases, base, cand, strict=True):
        try:
            pair = Pair(case.tenant, registry.score(case, c), registry.score(case, b))
        except EvaluatorError as e:
            raise GateError(str(e)) from e
        pairs.append(pair)
        if pair.candidate < pair.serving and len(regressions) < 5:  # evidence for the card
            regressions.append({"case": case.id, "tenant": case.tenant, "serving": b.text[:200],
                                "candidate": c.text[:200], "scores": [pair.serving, pair.candidate]})
    assert state.factory is not None
    with state.factory() as s:
        margins = {tenant: state.policies.policy_for(s, tenant).max_regression for tenant in {p.tenant for p in pairs}}
    verdict = decide(pairs, margins)
    numbers = {
        **counts, "cases": len(pairs), "evaluators": dict(Counter(c.evaluator for c in evalset.cases)),
        "overall": verdict.overall.as_dict(), "tenants": {k: v.as_dict() for k, v in verdict.tenants.items()},
        "max_regression": margins, "bootstrap": {"seed": SEED, "resamples": RESAMPLES, "level": 0.95},
        "rule": "every tenant's ci_low >= -max_regression and overall ci_high >= 0",
        "reasons": verdict.reasons, "regressions": regressions,
    }
    return GateResult(GateState.passed if verdict.passed else GateState.failed, numbers, verdict.reasons)


def safety_gate(state: AppState, replay: Replay) -> GateResult:
    assert state.factory is not None
    with state.factory() as s:
        policies = {tenant: state.policies.policy_for(s, tenant) for tenant in {c.tenant for c in replay.evalset.cases}}
    verdict = safety.judge(replay.evalset.cases, replay.serving, replay.candidate, policy_of=policies.__getitem__,
                           detector=state.redactor)
    return GateResult(GateState.passed if verdict.passed else GateState.failed, dict(verdict.numbers), verdict.reasons)


async def _model_name(engine: EngineClient, replica: Replica) -> str:
    resp = await engine.models(replica.url, timeout=30.0)
    data = resp.json().get("data") if resp.status == 200 else None
    if not data:
        raise GateError(f"{replica.label}/v1/models answered {resp.status}: no model to evaluate")
    return data[0]["id"]


async def _answers(engine: EngineClient, replica: Replica, model: str, cases: list[EvalCase], timeout: float,
                   concurrency: int) -> list[Answer]:
    gate = asyncio.Semaphore(concurrency)

    async def one(case: EvalCase) -> Answer:
        body = {**case.request, "model": model, "temperature": 0.0, "seed": 0, "stream": False}
        async with gate:
            resp = await engine.chat(replica.url, body, timeout=timeout)
        if resp.status >= 400:
            raise GateError(f"case {case.id}: the engine answered {resp.status}: {resp.text[:300]}")
        return answer_of(resp.json())

    return list(await asyncio.gather(*(one(c) for c in cases)))


async def recheck_waiting(state: AppState, versions: Versions) -> None:
    """Every ATDP_EVAL_RECHECK_S: run the gates again of each candidate that waits for evaluation cases
    (`evaluating`, its replay gate `pending` and finished by no running task), oldest first; each run
    counts the cases and either evaluates or goes on waiting."""
    interval = state.settings.eval_recheck_s
    while not state.stopping.is_set():
        await asyncio.sleep(interval)
        if not versions.ready.is_set() or state.factory is None:
            continue

        def waiting(s) -> list[VersionRef]:
            rows = s.execute(select(t.ModelVersion).join(t.VersionGate, t.VersionGate.version_id == t.ModelVersion.id)
                             .where(t.ModelVersion.status == VersionStatus.evaluating, t.ModelVersion.layer == POLICY,
                                    t.VersionGate.gate == REPLAY_GATE, t.VersionGate.state == GateState.pending)
                             .order_by(t.ModelVersion.created_at)).scalars().all()
            return [VersionRef(row.id, row.name, row.checkpoint) for row in rows]

        try:
            refs = await run_db(state, waiting)
        except Exception as e:  # the database may be away: the next round asks again
            log.warning("could not look for candidates waiting for evaluation cases: %s: %s", type(e).__name__, e)
            continue
        for ref in refs:
            if ref.id not in versions.gate_tasks:
                versions.start_gates(ref, lambda ref=ref: run_gates(state, versions, ref, actor="system:recheck"))


async def resume_gates(state: AppState, versions: Versions) -> list[str]:
    """At start-up: run again the gates of every candidate a stopped proxy left `evaluating` (oldest
    first, one at a time, like any gates). Returns their names."""
    while not versions.ready.is_set():  # the serving version and the engines are known first
        if state.stopping.is_set():
            return []
        await asyncio.to_thread(versions.ready.wait, 1.0)

    def pending(s) -> list[VersionRef]:
        rows = s.scalars(select(t.ModelVersion).where(t.ModelVersion.status == VersionStatus.evaluating,
                                                      t.ModelVersion.layer == POLICY)
                         .order_by(t.ModelVersion.created_at)).all()
        for row in rows:
            s.add(t.AuditEvent(actor="system", action="version.gates_resumed", target=row.id, details={"name": row.name}))
        return [VersionRef(row.id, row.name, row.checkpoint) for row in rows]

    try:
        refs = await run_db(state, pending)
    except Exception:
        log.exception("could not look for candidates left evaluating; re-post them to run their gates")
        return []
    for ref in refs:
        log.warning("version %s was left evaluating by a proxy that stopped: running its gates again", ref.name)
        versions.start_gates(ref, lambda ref=ref: run_gates(state, versions, ref, actor="system:resumed"))
    return [ref.name for ref in refs]
