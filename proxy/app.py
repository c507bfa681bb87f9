"""The FastAPI application: state, authentication, body limits, routes, errors, lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy import calls, chat, db, telemetry
from proxy.auth import Principal, hash_key, key_from_headers
from proxy.config import Settings
from proxy.errors import ApiError, Flavor, error_response, flavor_for_path
from proxy.sessions import ContinuationIndex, StepLink
from proxy.upstream import ReplicaPool, make_client, make_session
from proxy.writer_process import WriterProcess, build_recorder

log = logging.getLogger("atdp.app")


@dataclass
class AppState:
    settings: Settings
    pool: ReplicaPool
    index: ContinuationIndex
    recorder: Any  # proxy.writer.Recorder (thread mode) or proxy.writer_process.WriterProcess
    tracer: telemetry.Tracer
    factory: Any = None  # sqlalchemy sessionmaker, None until the database is reachable
    engine: Any = None
    client: Any = None  # httpx.AsyncClient, for control calls (swaps, model listings)
    http: Any = None  # aiohttp.ClientSession, for model traffic (the hot path)
    keys: dict[str, Principal] = field(default_factory=dict)  # sha256(key) -> principal
    misses: dict[str, float] = field(default_factory=dict)  # unknown key hashes, to not hammer the DB
    redactor: Any = None
    settings_upstream_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    stopping: threading.Event = field(default_factory=threading.Event)  # set when the app shuts down

    # --- authentication -------------------------------------------------------------------------

    async def authenticate(self, request: Request, *, admin: bool = False) -> Principal:
        key = key_from_headers(request.headers)
        s = self.settings
        if key and s.admin_key and hmac.compare_digest(key.encode(), s.admin_key.encode()):
            return Principal(tenant=request.headers.get("x-atdp-tenant") or s.default_tenant, key_id="admin",
                             is_admin=True)
        if key is None:
            if s.open_mode and not admin:
                return Principal(tenant=s.default_tenant, key_id=None)
            raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           type="authentication_error", code="invalid_api_key")
        h = hash_key(key)
        principal = self.keys.get(h)
        if principal is None and self.misses.get(h, 0) < time.monotonic():
            try:
                principal = await self._lookup(h)
            except ApiError:
                if not s.open_mode:
                    raise
        if principal is None:
            if s.open_mode and not admin:  # local use: clients send placeholder keys; they're the default tenant
                return Principal(tenant=s.default_tenant, key_id=None)
            raise ApiError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        if admin and not principal.is_admin:
            raise ApiError(403, "this route needs the admin key", type="permission_error")
        return principal

    async def _lookup(self, h: str) -> Principal | None:
        if self.factory is None:
            raise ApiError(503, "cannot verify the API key: the database is unavailable")

        def query():
            from sqlalchemy import select

            from proxy import tables as t

            with self.factory() as ses:
                row = ses.execute(
                    select(t.ApiKey).where(t.ApiKey.key_hash == h, t.ApiKey.revoked_at.is_(None))
                ).scalar_one_or_none()
                return None if row is None else Principal(tenant=row.tenant_id, key_id=row.id, is_admin=row.is_admin)

        try:
            principal = await asyncio.wait_for(asyncio.to_thread(query), 3.0)
        except Exception:
            raise ApiError(503, "cannot verify the API key: the database is unavailable") from None
        if principal is None:
            self.misses[h] = time.monotonic() + 2.0
        else:
            self.keys[h] = principal
        return principal

    def load_keys(self) -> None:
        from sqlalchemy import select

        from proxy import tables as t

        with self.factory() as ses:
            rows = ses.execute(select(t.ApiKey).where(t.ApiKey.revoked_at.is_(None))).scalars().all()
        self.keys = {r.key_hash: Principal(tenant=r.tenant_id, key_id=r.id, is_admin=r.is_admin) for r in rows}


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over the {limit}-byte limit")
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None


def _warm_index(state: AppState) -> None:
    """Re-learn recent transcripts from the database, so continuation survives a restart."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import select

    from proxy import tables as t

    since = datetime.now(UTC) - timedelta(seconds=state.settings.session_ttl_s)
    with state.factory() as s:
        rows = s.execute(
            select(t.Step.transcript_hash, t.Step.id, t.Session.external_id)
            .join(t.Session, t.Session.id == t.Step.session_id)
            .where(t.Step.transcript_hash.is_not(None), t.Step.started_at >= since)
            .order_by(t.Step.started_at.desc())
            .limit(state.index.max_entries)
        ).all()
    for th, sid, ext in reversed(rows):
        state.index.add(th, StepLink(step_id=sid, session_id=ext))


def _connect_database(state: AppState) -> None:
    """Find (or start) the database, migrate it, load keys and warm the index. Retries in the background."""
    settings = state.settings
    while True:
        try:
            url = db.database_url(settings)
            db.upgrade(url)
            engine = db.make_engine(url)
            state.engine = engine
            state.factory = db.session_factory(engine)
            state.recorder.connect(url, state.factory)
            state.load_keys()
            _warm_index(state)
            for hook in state.extra.get("on_db", []):
                hook(state)
            log.info("database ready")
            return
        except Exception as e:
            if state.stopping.is_set():
                return
            log.warning("database not ready (%s: %s); serving anyway, steps go to the spool", type(e).__name__, e)
            if state.stopping.wait(2.0):
                return


class LazyRedactor:
    """An in-process Redactor built on first use (Presidio takes a second to load)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._r = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._r is None:
                from proxy.redaction import RedactionConfig, Redactor

                self._r = Redactor(RedactionConfig(salt=self._secret))
            return self._r

    def redact_value(self, value, tenant: str, **kw):
        return self.get().redact_value(value, tenant, **kw)

    def redact_text(self, text: str, tenant: str):
        return self.get().redact_text(text, tenant)

    def redact_many(self, items, **kw):
        return [self.get().redact_value(v, tenant) for tenant, v in items]


def create_app(settings: Settings, *, redactor=None, connect_db: bool = True) -> FastAPI:
    owns_redactor = redactor is None
    if redactor is None and settings.writer_mode == "process":
        recorder = WriterProcess(settings)
        redactor = LazyRedactor(settings.secret)  # for the few texts control routes persist (feedback)
    else:
        recorder = build_recorder(settings, redactor=redactor)
        redactor = recorder.redactor
    state = AppState(
        settings=settings,
        pool=ReplicaPool(settings.upstream_urls, hold_timeout_s=settings.swap_hold_timeout_s),
        index=ContinuationIndex(ttl_s=settings.session_ttl_s),
        recorder=recorder,
        tracer=telemetry.Tracer(settings.otel_exporter),
        redactor=redactor,
        settings_upstream_key=settings.upstream_api_key,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.client = make_client(settings.upstream_timeout_s)
        state.http = make_session(settings.upstream_timeout_s)
        recorder.start()
        stop = asyncio.Event()
        tasks = []
        if connect_db:
            threading.Thread(target=_connect_database, args=(state,), name="atdp-db-connect", daemon=True).start()
            tasks.append(asyncio.create_task(_refresh_keys(state, stop)))
        for hook in state.extra.get("on_start", []):
            await hook(state)
        import gc

        gc.collect()
        gc.freeze()  # what start-up built lives for the process: keep it out of every later collection
        try:
            yield
        finally:
            stop.set()
            state.stopping.set()
            for task in tasks:
                task.cancel()
            await state.client.aclose()
            await state.http.close()
            await asyncio.to_thread(recorder.stop)
            if owns_redactor and hasattr(redactor, "close"):
                redactor.close()
            state.tracer.shutdown()
            if state.engine is not None:
                state.engine.dispose()

    app = FastAPI(title="atdp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.atdp = state
    _install_routes(app, state)
    return app


async def _refresh_keys(state: AppState, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(5.0)
        if state.factory is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(state.load_keys)


def door(state: AppState, flavor: Flavor, handler: Callable, *, admin: bool = False):
    """Wrap a model-traffic handler: authenticate, read the JSON body, bind call_begin."""

    async def endpoint(request: Request) -> Response:
        principal = await state.authenticate(request, admin=admin)
        body = await read_json(request, state.settings.max_body_bytes)
        path_session = request.path_params.get("session_id")

        def call_begin(api: str, b: dict, messages: list, **kw) -> calls.Call:
            return calls.begin(state, request, principal, api=api, body=b, messages=messages,
                               path_session=path_session, **kw)

        return await handler(request, body, call_begin)

    return endpoint


SESSION_PREFIXES = ("", "/s/{session_id}")  # /s/{id}/v1/... for clients that can only change the base URL


def add_route(app: FastAPI, path: str, endpoint: Callable, methods: list[str]) -> None:
    """A plain Starlette route: model traffic skips FastAPI's per-request dependency machinery."""
    app.router.add_route(path, endpoint, methods=methods)


def _install_routes(app: FastAPI, state: AppState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(flavor_for_path(request.url.path), exc.status, exc.message, type=exc.type,
                              code=exc.code, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        return error_response(flavor_for_path(request.url.path), exc.status_code, f"{message}: {request.method} {request.url.path}")

    chat_endpoint = door(state, "openai", chat.handle)
    for prefix in SESSION_PREFIXES:
        add_route(app, prefix + "/v1/chat/completions", chat_endpoint, ["POST"])
        add_route(app, prefix + "/v1/models", _models(state), ["GET"])
        add_route(app, prefix + "/v1/models/{model_id:path}", _models(state), ["GET"])

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return Response(orjson.dumps({"service": "atdp"}), media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> Response:
        r = state.recorder
        body = {
            "status": "ok",
            "database": bool(state.factory is not None and r.db_ok),
            "writer_pending": r.pending,
            "spool_pending": r.spool.pending(),
            "replicas": [{"url": x.url, "alive": x.alive, "open": x.is_open, "version": x.version, "inflight": x.inflight}
                         for x in state.pool.replicas],
        }
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(telemetry.render_metrics(state.recorder), media_type="text/plain; version=0.0.4")

    for module in ("proxy.messages", "proxy.responses", "proxy.feedback", "proxy.versions", "proxy.admin"):
        import importlib

        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.install(app, state)


def _models(state: AppState):
    async def models(request: Request) -> Response:
        await state.authenticate(request)
        model_id = request.path_params.get("model_id")
        path = "/v1/models" + (f"/{model_id}" if model_id else "")
        last = "no replica answered"
        for replica in state.pool.candidates("models"):
            try:
                resp = await state.client.get(replica.url + "/v1/models")
            except Exception as e:
                last = f"{type(e).__name__}"
                continue
            if resp.status_code != 200:
                last = f"{replica.url} answered {resp.status_code}"
                continue
            listing = resp.json()
            if not model_id:
                return Response(resp.content, media_type="application/json")
            for m in listing.get("data", []):
                if m.get("id") == model_id:
                    return Response(orjson.dumps(m), media_type="application/json")
            raise ApiError(404, f"model '{model_id}' not found", code="model_not_found")
        raise ApiError(502, f"upstream unavailable for {path}: {last}")

    return models
