"""Request plumbing every route uses: the route record, JSON in and out, database calls off the loop,
and `door` (authenticate, read the body, bind the call)."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response

from proxy import call as calls
from proxy.auth import Principal, header_map
from proxy.errors import ApiError, flavor_for_path
from proxy.shapes import MAX_DEPTH, MAX_ID, MAX_TENANT, ShapeError, check, id_problem, too_deep
from proxy.state import AppState

log = logging.getLogger("atdp.http")

Endpoint = Callable[[Request], Awaitable[Response]]
# A door's handler: (request, parsed body, call_begin) -> response; call_begin binds session and principal.
CallBegin = Callable[..., Awaitable[calls.Call]]
Handler = Callable[[Request, Any, CallBegin], Awaitable[Response]]
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

SESSION_PREFIXES = ("", "/s/{session_id}")  # /s/{id}/v1/... for clients that can only change the base URL
DB_UNAVAILABLE = "the database is unavailable; try again shortly"


@dataclass(frozen=True)
class Route:
    path: str
    endpoint: Endpoint
    methods: tuple[str, ...]


def model_routes(path: str, endpoint: Endpoint, methods: tuple[str, ...] = ("POST",)) -> list[Route]:
    """A model-traffic route, plain and under the `/s/{session_id}` prefix."""
    return [Route(prefix + path, endpoint, methods) for prefix in SESSION_PREFIXES]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


async def read_json(request: Request, limit: int) -> Any:
    return (await read_json_raw(request, limit))[1]


async def read_json_raw(request: Request, limit: int) -> tuple[bytes, Any]:
    """(the body's bytes as sent, the body parsed), or a 413 / 400."""
    declared = header_map(request.scope).get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over the {limit}-byte limit")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # orjson's message says where (line, column), never what: safe to pass on.
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if too_deep(body):
        raise ApiError(400, f"request body nests deeper than {MAX_DEPTH} levels")
    return raw, body


def check_body(model: type[M], body: Any, request: Request) -> M:
    """The body as its pydantic model, or a 400 in the called API's words (naming the field only)."""
    flavor = flavor_for_path(request.scope["path"])  # not request.url: that parses a whole URL
    try:
        return check(model, body, style=flavor)
    except ShapeError as e:
        raise ApiError(400, e.message, param=e.param) from None


def check_id(name: str, value: object, status: int = 400) -> None:
    """Refuse an identifier (path, header, query) that the store could not hold; name it, not its value."""
    if problem := id_problem(value, MAX_TENANT if name == "tenant" else MAX_ID):
        raise ApiError(status, f"{name} {problem}", param=name)


def path_id(request: Request, name: str) -> str:
    """A path parameter that is an identifier (session id, tenant, version), checked."""
    value = request.path_params[name]
    check_id(name, value)
    return value


def log_exception(where: str, e: BaseException) -> None:
    """Log an unexpected exception: its type and where it happened, never its message or locals
    (they may hold request values)."""
    frames = "".join(traceback.format_list(traceback.extract_tb(e.__traceback__)))
    log.error("unexpected %s in %s\nTraceback (message withheld: it may hold request values):\n%s",
              type(e).__name__, where, frames)


async def run_db(state: AppState, fn: Callable[[Session], T]) -> T:
    """Run `fn(session)` in a worker thread, in one transaction; database trouble becomes a 503."""
    factory = state.factory
    if factory is None:
        raise ApiError(503, DB_UNAVAILABLE)

    def work() -> T:
        with factory() as s, s.begin():
            return fn(s)

    try:
        return await asyncio.to_thread(work)
    except (OperationalError, InterfaceError):
        raise ApiError(503, DB_UNAVAILABLE) from None


def scope_tenant(request: Request, principal: Principal) -> str | None:
    """The tenant a call may see: its own; for the admin key, the one it names (None = all)."""
    if principal.is_admin:
        named = request.query_params.get("tenant") or request.headers.get("x-atdp-tenant") or None
        if named is not None:
            check_id("tenant", named)
        return named
    return principal.tenant


def door(state: AppState, handler: Handler) -> Endpoint:
    """Wrap a model-traffic handler: authenticate, read the JSON body, bind call_begin."""

    async def endpoint(request: Request) -> Response:
        principal = await state.authenticate(request)
        refused = state.recorder.refusing()
        if refused is not None:
            # A call answered now could not be recorded (the spool is failing): refuse it rather
            # than answer and lose it. Rendered in the door's own error format.
            raise ApiError(503, f"{refused}; try again shortly", headers={"retry-after": "5"})
        raw, body = await read_json_raw(request, state.settings.max_body_bytes)
        path_session = request.path_params.get("session_id")
        begun: list[calls.Call] = []

        async def call_begin(api: str, b: dict[str, Any], messages: list[Any], **kw: Any) -> calls.Call:
            call = await calls.begin(state, request, principal, api=api, body=b, raw_body=raw, messages=messages,
                               path_session=path_session, **kw)
            begun.append(call)
            return call

        try:
            return await handler(request, body, call_begin)
        except ApiError:
            raise
        except Exception as e:
            # A bug, not the client's fault: a 500 in the door's own shape, and the call (when it
            # had begun) recorded as a failed step through the normal, redacted path.
            log_exception(request.url.path.rsplit("/v1/", 1)[-1], e)
            headers: dict[str, str] = {}
            for call in begun:
                await calls.close_upstream(call, None)
                calls.finish(call, status="error", error={"type": "internal_error", "message": type(e).__name__})
                headers = call.response_headers()
            raise ApiError(500, "internal error in the proxy; the call was recorded as failed",
                           headers=headers) from None

    return endpoint

