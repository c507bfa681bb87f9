"""The diagnosis route: where to fix (proxy.evolve.diagnose, docs/diagnosis.md).

    GET /atdp/v1/diagnosis    ranked findings (the admin key: every tenant, or ?tenant=; a tenant key:
                              its own tenant only). Query parameters named like a rule override it
                              for this call (?window_days=1&min_failures=5); bad values are a 400.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import ApiError
from proxy.evolve.diagnose import diagnose
from proxy.evolve.rules import Rules, RulesError, load_rules, rules_from_mapping
from proxy.http import Route, json_response, run_db
from proxy.state import AppState


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
    overrides = {k: _number(k, v) for k, v in request.query_params.items() if k != "tenant"}
    try:
        return rules_from_mapping(overrides, base)
    except RulesError as e:
        raise ApiError(400, str(e)) from None


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
        result = await run_db(state, lambda s: diagnose(s, rules, tenant=tenant))
        return json_response(result.to_dict())

    return [Route("/atdp/v1/diagnosis", get_diagnosis, ("GET",))]
