"""A candidate's gates, run in the background after `POST /atdp/v1/versions`, then its promotion.

candidate -> evaluating -> (gates) -> canary (proxy.control.canary, when it is on) or serving, or ->
rejected. With the canary off a candidate whose gates pass is promoted to every replica directly.

Gate 1, replay evaluation (`replay_eval`): the evaluation set (proxy.evaluation.cases: operator suites
and the tenants' held-out sessions) is replayed greedily (temperature 0) on one replica, first with
the serving weights, then with the candidate's, loaded with the swap machinery; the serving weights
are loaded back before the replica reopens. Scores come from the evaluators (proxy.evaluation
.evaluators), the verdict from proxy.evaluation.stats.
- no cases at all: the gate is `skipped` and the candidate is promoted (gates stay off until the
  operator configures suites or a held-out share);
- the candidate's weights do not load: the version is `failed` (as a failed swap);
- an evaluator or a suite is broken: the gate is `error` and the version `rejected` (fail closed).

While the candidate is loaded, that replica's gate is closed: other replicas serve, and on a
single-replica install calls wait for it (up to ATDP_SWAP_HOLD_TIMEOUT_S), like during a swap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from atdp_schema.models import GateState, VersionStatus
from proxy.control.canary import begin as begin_canary
from proxy.control.canary import wait_for_canary
from proxy.control.swap import Versions, load_weights
from proxy.evaluation.cases import Answer, EvalCase, EvalSet, SuiteError, add_held_out, load_suites
from proxy.evaluation.evaluators import EvaluatorError, Registry
from proxy.evaluation.stats import RESAMPLES, SEED, Pair, decide
from proxy.http import run_db
from proxy.state import AppState
from proxy.store.versions import (
    REPLAY_GATE,
    VersionRef,
    mark_failed,
    mark_rejected,
    record_swap,
    set_gate,
    set_status,
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
    await wait_for_canary(versions)  # one canary at a time: a running one is decided first
    async with versions.lock:
        def begin(s) -> None:
            set_status(s, target.id, VersionStatus.evaluating)
            set_gate(s, target.id, REPLAY_GATE, GateState.running)

        await run_db(state, begin)
        t0 = time.perf_counter()
        try:
            result = await replay_gate(state, versions, target)
        except _CandidateLoadError as e:
            error = f"candidate weights did not load: {e}"
            await run_db(state, lambda s: (set_gate(s, target.id, REPLAY_GATE, GateState.error, {"error": error},
                                                    finished=True), mark_failed(s, target.id, error, actor=actor)))
            return None
        except Exception as e:  # fail closed: a gate that cannot run does not let the version through
            log.exception("replay gate of %s could not run", target.name)
            result = GateResult(GateState.error, {"error": f"{type(e).__name__}: {e}"},
                                [f"replay evaluation could not run: {type(e).__name__}: {e}"])
        result.numbers["seconds"] = round(time.perf_counter() - t0, 3)
        await run_db(state, lambda s: set_gate(s, target.id, REPLAY_GATE, result.state, result.numbers, finished=True))
        if result.state not in (GateState.passed, GateState.skipped):
            await run_db(state, lambda s: mark_rejected(s, target.id, result.reasons, actor="gate:" + REPLAY_GATE))
            log.warning("version %s rejected: %s", target.name, "; ".join(result.reasons))
            return None
        # Passed (or nothing to evaluate on): the canary (gate 3), when it is on; else every replica now.
        canary = await begin_canary(state, versions, target, actor=actor)
        if canary is not None:
            return canary
        outcome = await versions.swap(target)
        await run_db(state, lambda s: record_swap(s, target, outcome, actor=actor, left_status=VersionStatus.retired,
                                                  candidate=True))
        return outcome


class _CandidateLoadError(Exception):
    pass


async def replay_gate(state: AppState, versions: Versions, target: VersionRef) -> GateResult:
    settings = state.settings
    evalset = await asyncio.to_thread(_collect, state)
    counts = {"suite_cases": sum(c.source.startswith("suite:") for c in evalset.cases),
              "held_out_cases": sum(c.source.startswith("held-out:") for c in evalset.cases),
              "held_out_sessions": evalset.held_out_sessions, "unscored_held_out_steps": evalset.unscored_held_out}
    if not evalset.cases:
        return GateResult(GateState.skipped, {**counts, "reason": "no evaluation cases (no operator suite, no "
                                              "held-out session with a task rule)"}, [])
    serving = versions.current
    if serving is None:
        raise GateError("the serving version is not known yet")
    pool, client, headers = state.pool, state.client, state.pool.auth_headers
    assert client is not None, "the app is not started"
    replica = next((r for r in pool.replicas if r.alive), pool.replicas[0])
    model = await _model_name(client, replica, headers)
    timeout = settings.upstream_timeout_s
    # The serving weights answer first, with the replica open (its weights do not change).
    base_answers = await _answers(client, replica, model, evalset.cases, headers, timeout, settings.eval_concurrency)
    async with pool.swapping(replica, versions.drain_timeout_s):
        try:
            await load_weights(client, replica, target.checkpoint, target.name, headers=headers,
                               timeout_s=versions.load_timeout_s)
        except Exception as e:
            await versions.restore(replica, serving)
            raise _CandidateLoadError(f"{type(e).__name__}: {e}") from e
        try:
            cand_answers = await _answers(client, replica, model, evalset.cases, headers, timeout, settings.eval_concurrency)
        finally:
            await versions.restore(replica, serving)  # reopen only with the serving weights back
    return await asyncio.to_thread(_score, state, evalset, base_answers, cand_answers, counts)


def _collect(state: AppState) -> EvalSet:
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
            add_held_out(s, evalset, holdout, max_cases=settings.eval_max_cases, max_tokens=settings.eval_max_tokens)
    return evalset


def _score(state: AppState, evalset: EvalSet, base: list[Answer], cand: list[Answer], counts: dict) -> GateResult:
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


async def _model_name(client: httpx.AsyncClient, replica: Replica, headers: dict[str, str]) -> str:
    resp = await client.get(replica.url + "/v1/models", headers=headers, timeout=30.0)
    data = resp.json().get("data") if resp.status_code == 200 else None
    if not data:
        raise GateError(f"{replica.url}/v1/models answered {resp.status_code}: no model to evaluate")
    return data[0]["id"]


async def _answers(client: httpx.AsyncClient, replica: Replica, model: str, cases: list[EvalCase],
                   headers: dict[str, str], timeout: float, concurrency: int) -> list[Answer]:
    gate = asyncio.Semaphore(concurrency)

    async def one(case: EvalCase) -> Answer:
        body = {**case.request, "model": model, "temperature": 0.0, "seed": 0, "stream": False}
        async with gate:
            resp = await client.post(replica.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)
        if resp.status_code >= 400:
            raise GateError(f"case {case.id}: the engine answered {resp.status_code}: {resp.text[:300]}")
        message = resp.json()["choices"][0]["message"]
        calls = [{"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
                 for c in message.get("tool_calls") or []]
        return Answer(text=message.get("content") or "", tool_calls=calls)

    return list(await asyncio.gather(*(one(c) for c in cases)))
