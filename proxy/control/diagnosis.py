"""The diagnosis route: where to fix (proxy.evolve.diagnose, docs/diagnosis.md).

    GET /atdp/v1/diagnosis    ranked findings (the admin key: every tenant, or ?tenant=; a tenant key:
                              its own tenant only). Query parameters named like a rule override it
                              for this call (?window_days=1&min_failures=5); bad values are a 400.
                              `?fresh=1` waits for a diagnosis of the store as it is now.

Served from a snapshot (proxy.evolve.snapshot): `generated_at` says when it was computed, and
`newer_data` whether the store has changed since (a newer one is then being computed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import ApiError
from proxy.evolve.diagnose import diagnose
from proxy.evolve.rules import Rules, RulesError, load_rules, rules_from_mapping
from proxy.evolve.snapshot import Snapshot, store_marker
from proxy.http import Route, json_response, run_db
from proxy.state import AppState

log = logging.getLogger("atdp.diagnosis")


def _number(key: str, raw: str) -> int | float:
    try:
        return int(raw)
    except ValueError:
        try:
            return float(raw)
        except ValueError:
            raise ApiError(400, f"{key} must be a number") from None


def _rules(state: AppState, request: Request) -> Rules:
    try:
        base = load_rules(state.settings.diagnosis_file)
    except RulesError as e:
        raise ApiError(500, f"the server's diagnosis rules are invalid: {e}") from None
    overrides = {k: _number(k, v) for k, v in request.query_params.items() if k not in ("tenant", "fresh")}
    try:
        return rules_from_mapping(overrides, base)
    except RulesError as e:
        raise ApiError(400, str(e)) from None


def _compute(state: AppState, tenant: str | None, rules: Rules) -> Callable[[], Awaitable[Snapshot]]:
    async def compute() -> Snapshot:
        started = time.monotonic()
        # One transaction: the marker describes exactly the store the diagnosis read.
        marker, result = await run_db(state, lambda s: (store_marker(s), diagnose(s, rules, tenant=tenant).to_dict()))
        return Snapshot(marker, result, started)
    return compute


async def warm(state: AppState) -> None:
    """At start-up: the all-tenants diagnosis with the server's rules, so the first page is fast."""
    while state.factory is None:  # the database connects in the background
        if state.stopping.is_set():
            return
        await asyncio.sleep(0.5)
    try:
        rules = load_rules(state.settings.diagnosis_file)
        marker = await run_db(state, store_marker)
        await state.diagnosis.get((None, rules), marker, _compute(state, None, rules))
    except Exception as e:  # a bad rules file or the database away: the route reports it when asked
        log.warning("diagnosis warm-up skipped: %s", type(e).__name__)


def routes(state: AppState) -> list[Route]:
    async def get_diagnosis(request: Request) -> Response:
        principal = await state.authenticate(request)
        asked = request.query_params.get("tenant")
        if principal.is_admin:
            tenant = asked or None
        elif asked and asked != principal.tenant:
            raise ApiError(403, "a tenant key may diagnose only its own tenant", type="permission_error")
        else:
            tenant = principal.tenant
        rules = _rules(state, request)
        fresh = request.query_params.get("fresh") not in (None, "", "0", "false")
        marker = await run_db(state, store_marker)
        compute = _compute(state, tenant, rules)
        if fresh:
            snap = await compute()
            return json_response({**snap.result, "newer_data": False})
        return json_response(await state.diagnosis.get((tenant, rules), marker, compute))

    return [Route("/atdp/v1/diagnosis", get_diagnosis, ("GET",))]
