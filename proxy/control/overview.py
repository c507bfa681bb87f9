"""Read routes the console needs beyond the session, feedback, version and diagnosis routes.

    GET /atdp/v1/whoami     who the key is: its tenant, or the admin key (so the console knows which
                            pages and buttons to offer; the routes themselves still check).
    GET /atdp/v1/learning   reward and held-out score per model version (proxy.store.learning): a
                            tenant key sees its own tenant's; the admin key every tenant's, or ?tenant=.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import ApiError
from proxy.http import Endpoint, Route, json_response, run_db, scope_tenant
from proxy.state import AppState
from proxy.store.learning import learning


def routes(state: AppState) -> list[Route]:
    return [
        Route("/atdp/v1/whoami", _whoami(state), ("GET",)),
        Route("/atdp/v1/learning", _learning(state), ("GET",)),
    ]


def _whoami(state: AppState) -> Endpoint:
    async def whoami(request: Request) -> Response:
        principal = await state.authenticate(request)
        return json_response({"admin": principal.is_admin, "tenant": None if principal.is_admin else principal.tenant,
                              "key_id": principal.key_id})

    return whoami


def _learning(state: AppState) -> Endpoint:
    async def get_learning(request: Request) -> Response:
        principal = await state.authenticate(request)
        unknown = sorted(set(request.query_params.keys()) - {"tenant"})
        if unknown:
            raise ApiError(422, f"unknown query parameters {unknown}; known: ['tenant']")
        asked = request.query_params.get("tenant")
        if not principal.is_admin and asked and asked != principal.tenant:
            raise ApiError(403, "a tenant key sees only its own tenant", type="permission_error")
        tenant = scope_tenant(request, principal)
        rows = await run_db(state, lambda s: learning(s, tenant))
        return json_response({"tenant": tenant, "data": rows})

    return get_learning
