"""`GET /v1/models`, `GET /v1/models/{id}`: what the upstream serves, from the first replica that answers."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from proxy.engine import EngineUnreachable
from proxy.errors import ApiError
from proxy.http import Endpoint, Route, json_response, model_routes
from proxy.state import AppState
from proxy.upstream import Replica, ReplicaFailed, failover


def models_endpoint(state: AppState) -> Endpoint:
    async def models(request: Request) -> Response:
        await state.authenticate(request)
        model_id = request.path_params.get("model_id")
        engine = state.engine_client
        assert engine is not None, "the app is not started"

        async def attempt(replica: Replica) -> Response:
            try:
                resp = await engine.models(replica.url)
            except EngineUnreachable as e:
                raise ReplicaFailed(f"{replica.label}: {e.kind}") from None
            if resp.status != 200:
                raise ReplicaFailed(f"{replica.label} answered {resp.status}")
            if not model_id:
                return Response(resp.body, media_type="application/json")
            for m in resp.json().get("data", []):
                if m.get("id") == model_id:
                    return json_response(m)
            raise ApiError(404, f"model '{model_id}' not found", code="model_not_found")

        return await failover(state.pool, "models", attempt)

    return models


async def root(_request: Request) -> Response:
    return Response(orjson.dumps({"service": "atdp"}), media_type="application/json")


def routes(state: AppState) -> list[Route]:
    endpoint = models_endpoint(state)
    return [*model_routes("/v1/models", endpoint, ("GET",)), *model_routes("/v1/models/{model_id:path}", endpoint, ("GET",))]
