"""The shadow gate of a harness or memory candidate: live calls mirrored to it, never served.

With `ATDP_SHADOW_CALLS` > 0, a candidate whose replay and safety gates passed registers a run with the
proxy's tap (proxy.layers.shadow) before its canary or promotion. A live call of its scope, taken at
random (`ATDP_SHADOW_SHARE`), is answered twice more once it has gone out, on a task: the body as it was
served and the body with the candidate in place of its layer's serving version, both unstreamed, with
the client's own parameters (this gate measures live behaviour; the replay gate is the greedy one). A
call the candidate would not change is not mirrored (nothing to learn, and it would cost two calls).
The answers are judged and compared by proxy.evaluation.shadow; the gate row carries the numbers while
it runs. Only the proxy that runs the candidate's gates mirrors (its own share of the traffic).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from atdp_schema.models import GateState
from proxy import providers
from proxy.evaluation.shadow import Arm, ShadowNumbers, mirrored, verdict
from proxy.http import run_db
from proxy.layers.serving import Applied, LayerVersion
from proxy.layers.shadow import Mirror, ShadowRun
from proxy.rollout.gates import GateResult, answer_of
from proxy.state import AppState
from proxy.store.layers import HARNESS
from proxy.store.versions import set_gate

log = logging.getLogger("atdp.layers.shadow")

SHADOW_GATE = "shadow"
POLL_S = 0.5


def shadow_on(state: AppState) -> bool:
    return state.settings.shadow_calls > 0


def _unstreamed(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")} | {"stream": False}


async def _ask(state: AppState, body: dict[str, Any]) -> Arm | None:
    """One arm's answer, where the live call went (its provider route, else a replica). None: the upstream
    could not answer at all (unreachable, 5xx), which is neither arm's doing."""
    route = state.routes.match(body.get("model"))
    try:
        if route is not None:
            resp = await providers.open_provider(route, body)
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
            status = resp.status_code
        else:
            engine = state.engine_client
            assert engine is not None, "the app is not started"
            replica = next((r for r in state.pool.replicas if r.alive), state.pool.replicas[0])
            r = await engine.chat(replica.url, body, timeout=state.settings.upstream_timeout_s)
            data, status = r.body, r.status
    except Exception as e:
        log.info("a shadow mirror was not answered: %s", type(e).__name__)
        return None
    if status >= 500:
        return None
    if status >= 400:
        return Arm(None, status)
    try:
        return Arm(answer_of(orjson.loads(data)))
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def mirror_for(state: AppState, candidate: LayerVersion, numbers: ShadowNumbers) -> Mirror:
    async def mirror(body: dict[str, Any], served: dict[str, Any], tenant: str, applied: Applied) -> bool:
        harness, memory = ((candidate, applied.memory) if candidate.layer == HARNESS
                           else (applied.harness, candidate))
        as_candidate, _ = await state.layers.configure(body, tenant, harness, memory)
        serving_body, candidate_body = _unstreamed(served), _unstreamed(as_candidate)
        if serving_body == candidate_body:
            numbers.unchanged += 1
            return False
        serving, other = await asyncio.gather(_ask(state, serving_body), _ask(state, candidate_body))
        if serving is None or other is None:
            numbers.dropped += 1
            return False
        if len(numbers.results) >= numbers.wanted:
            return True
        # Judged against the tools as the client declared them: what its tools accept, whatever the
        # candidate says about them.
        numbers.results.append(mirrored(serving, other, body.get("tools")))
        return True

    return mirror


async def run_shadow(state: AppState, version_id: str, candidate: LayerVersion) -> GateResult | None:
    """Mirror live calls until enough are compared or the wait ends; the gate's result. None: the proxy
    is stopping (the version stays `evaluating`; its gates run again at the next start)."""
    s = state.settings
    numbers = ShadowNumbers(wanted=s.shadow_calls)
    state.shadow.runs[candidate.id] = ShadowRun(candidate, s.shadow_share, s.shadow_calls, s.shadow_concurrency,
                                                mirror_for(state, candidate, numbers))
    deadline = time.monotonic() + s.shadow_wait_s
    shown: dict[str, object] | None = None
    try:
        await run_db(state, lambda db: set_gate(db, version_id, SHADOW_GATE, GateState.running,
                                                numbers.as_numbers(interval=False)))
        while len(numbers.results) < numbers.wanted and time.monotonic() < deadline:
            if state.stopping.is_set():
                return None
            await asyncio.sleep(POLL_S)
            now = numbers.as_numbers(interval=False)
            if now != shown:  # progress on the card and the console while it runs
                try:
                    await run_db(state, lambda db, n=now: set_gate(db, version_id, SHADOW_GATE, GateState.running, n))
                    shown = now
                except Exception as e:
                    log.warning("shadow progress of %s not written: %s", candidate.name, type(e).__name__)
    finally:
        state.shadow.runs.pop(candidate.id, None)
    numbers.results = numbers.results[: numbers.wanted]  # a mirror still in flight adds nothing now

    def judge() -> tuple[bool, list[str], dict[str, object]]:  # the bootstrap, off the event loop
        passed, reasons = verdict(numbers)
        return passed, reasons, {**numbers.as_numbers(), "reasons": reasons}

    passed, reasons, out = await asyncio.to_thread(judge)
    return GateResult(GateState.passed if passed else GateState.failed, out, reasons)
