"""The Starlette application: state, the route table, errors, lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import orjson
from sqlalchemy import select
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.routing import Route as StarletteRoute
from starlette.types import ASGIApp, ExceptionHandler, Message, Receive, Scope, Send

from proxy import logs, memtrace, openapi, providers, telemetry
from proxy.config import Settings
from proxy.console import routes as console
from proxy.control import admin, diagnosis, feedback, overview, sessions, versions
from proxy.doors import chat, messages, models, responses
from proxy.doors.response_store import ResponseStore
from proxy.engine import EngineClient
from proxy.errors import ApiError, error_response, flavor_for_path
from proxy.evolve.snapshot import DiagnosisCache
from proxy.governance.ner import NerStatus, ner_status
from proxy.governance.policies import Policies
from proxy.governance.redaction import LazyRedactor, TextRedactor
from proxy.http import Endpoint, Route, json_response, log_exception, run_db
from proxy.layers.serving import Layers
from proxy.record.durability import Writer
from proxy.record.writer_process import WriterProcess, build_recorder
from proxy.rollout import canary, canarybus, gates
from proxy.rollout import layer_gates as layer_gates_mod
from proxy.rollout.layer_gates import LayerGates
from proxy.rollout.swap import Versions
from proxy.rollout.swapbus import SwapBus
from proxy.sessions import ContinuationIndex, StepLink
from proxy.state import AppState
from proxy.store import db, partitions
from proxy.store import tables as t
from proxy.store.links import LinkStore
from proxy.store.presence import Presence
from proxy.upstream import ReplicaPool

log = logging.getLogger("atdp.app")


def route_table(state: AppState, store: ResponseStore, swaps: Versions, ner: NerStatus | None = None,
                layer_gates: LayerGates | None = None) -> list[Route]:
    """Every route the proxy serves, in one place. `ner`: whether names can be redacted (for /healthz)."""
    ner = ner or ner_status(state.settings.ner_model)
    return [
        *chat.routes(state),
        *messages.routes(state),
        *responses.routes(state, store),
        *models.routes(state),
        *sessions.routes(state),
        *feedback.routes(state),
        *versions.routes(state, swaps, layer_gates or LayerGates()),
        *admin.routes(state),
        *diagnosis.routes(state),
        *overview.routes(state),
        *console.routes(),
        Route("/", models.root, ("GET", "HEAD")),
        Route("/healthz", _healthz(state, swaps, ner), ("GET",)),
        Route("/metrics", _metrics(state), ("GET",)),
        Route("/openapi.json", _openapi(), ("GET",)),
    ]


async def _warm_up_providers() -> None:
    await asyncio.to_thread(providers.warm_up)
    gc.freeze()  # LiteLLM's modules live for the process too: keep them out of later collections


def create_app(settings: Settings, *, redactor: TextRedactor | None = None, connect_db: bool = True) -> Starlette:
    logs.install()  # no credentials in HTTP clients' log lines, however the process set up logging
    policies = Policies.from_settings(settings)
    recorder: Writer
    if redactor is None and settings.writer_mode == "process":
        recorder = WriterProcess(settings, policies)
        # For the few texts control routes persist themselves (feedback comments).
        own_redactor: TextRedactor = LazyRedactor(settings.secret, settings.ner_model)
        owns_redactor = True
    else:
        in_process = build_recorder(settings, policies, redactor=redactor)
        recorder, own_redactor = in_process, in_process.redactor
        owns_redactor = redactor is None
    state = AppState(
        settings=settings,
        policies=policies,
        pool=ReplicaPool(settings.upstream_urls, hold_timeout_s=settings.swap_hold_timeout_s,
                         api_key=settings.upstream_api_key),
        index=ContinuationIndex(settings.continuation_entries, settings.session_ttl_s, settings.retry_window_s),
        diagnosis=DiagnosisCache(settings.diagnosis_max_age_s),
        recorder=recorder,
        redactor=own_redactor,
        tracer=telemetry.Tracer(settings.otel_exporter),
        routes=providers.build(settings.routes, os.environ, settings.upstream_timeout_s),
        layers=Layers(refresh_s=settings.layers_refresh_s, top_k=settings.memory_top_k),
    )
    store = ResponseStore(state, ttl_s=settings.response_ttl_s)
    swaps = Versions(state)
    layer_gates = LayerGates()  # harness and memory candidates' gates (proxy.rollout.layer_gates)
    # Names and places need the NER model: whether the writer can load it, read from its package
    # (cheap; the writer loads it off the request path). A redactor handed in says for itself.
    ner: NerStatus = getattr(redactor, "ner_status", None) or ner_status(settings.ner_model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine_client = EngineClient(settings.upstream_timeout_s, state.pool.auth_headers)
        recorder.start()
        if ner.available:
            log.info("redaction: names and places by NER model %s", ner.model)
        else:
            log.warning("redaction: names and places are NOT redacted: %s", ner.reason)
        tasks: list[asyncio.Task[None]] = []
        if state.routes.has_providers:  # LiteLLM's import takes seconds: not on the first provider call
            tasks.append(asyncio.create_task(_warm_up_providers()))
        if connect_db:
            threading.Thread(target=_connect_database, args=(state, swaps, asyncio.get_running_loop()),
                             name="atdp-db-connect",
                             daemon=True).start()
            tasks.append(asyncio.create_task(_refresh_keys(state)))
            tasks.append(asyncio.create_task(canary.resume(state, swaps)))
            tasks.append(asyncio.create_task(gates.resume_gates(state, swaps), name="atdp-resume-gates"))
            tasks.append(asyncio.create_task(gates.recheck_waiting(state, swaps), name="atdp-recheck-gates"))
            tasks.append(asyncio.create_task(diagnosis.warm(state), name="atdp-diagnosis-warm"))
            tasks.append(asyncio.create_task(state.layers.run(state.stopping), name="atdp-layers"))
            tasks.append(asyncio.create_task(layer_gates_mod.recheck_layers(state, layer_gates), name="atdp-layer-gates"))
        if connect_db:
            tasks.append(asyncio.create_task(_partition_upkeep(state)))
        if connect_db and settings.shared_links is not False:
            tasks.append(asyncio.create_task(_purge_links(state)))  # a no-op while this proxy is alone
            tasks.append(asyncio.create_task(_start_presence(state), name="atdp-presence-start"))
        if connect_db and settings.shared_swaps:
            tasks.append(asyncio.create_task(_start_swap_bus(state, swaps)))
        if settings.retention_interval_s > 0:
            tasks.append(asyncio.create_task(admin.retention_loop(state, settings.retention_interval_s)))
        gc.collect()
        gc.freeze()  # what start-up built lives for the process: keep it out of every later collection
        memtrace.start("proxy", settings.malloc_trim_s)  # glibc heap upkeep; snapshots when asked
        try:
            yield
        finally:
            state.stopping.set()
            for task in tasks:
                task.cancel()
            if swaps.starting is not None:  # still waiting for the engines
                swaps.starting.cancel()
            if swaps.canary_task is not None:  # a canary goes on after a restart (proxy.rollout.canary)
                swaps.canary_task.cancel()
            for task in [*layer_gates.tasks.values(), *layer_gates.canaries.tasks.values()]:  # likewise
                task.cancel()
            if state.presence is not None:
                await state.presence.close()
            if state.links is not None:
                await state.links.close()
            if swaps.bus is not None:
                await swaps.bus.close()
            await state.engine_client.close()
            await asyncio.to_thread(store.flush)  # stored responses go to the writer before it drains
            await asyncio.to_thread(recorder.stop)
            if owns_redactor:
                own_redactor.close()
            state.tracer.shutdown()
            for engine in (state.writer_engine, state.engine):
                if engine is not None:
                    engine.dispose()

    # Plain Starlette: FastAPI's per-request layers (its exit stack, body limit, native telemetry's
    # checks of the environment) cost every call CPU for features the proxy does not use; the
    # proxy's routes are plain endpoints, its OpenAPI document is written out (proxy.openapi).
    app = Starlette(
        routes=[StarletteRoute(r.path, r.endpoint, methods=list(r.methods)) for r in route_table(state, store, swaps, ner, layer_gates)],
        middleware=[Middleware(CatchAll)], exception_handlers=_error_handlers(), lifespan=lifespan,
    )
    app.state.atdp = state
    app.state.response_store = store
    app.state.versions = swaps
    return app


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(flavor_for_path(request.url.path), exc.status, exc.message, type=exc.type,
                          code=exc.code, headers=exc.headers, param=exc.param)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    # The method, not the path: a path may carry an id the caller made up.
    message = "route not found" if exc.status_code == 404 else str(exc.detail)
    return error_response(flavor_for_path(request.url.path), exc.status_code, f"{message} ({request.method})",
                          headers=exc.headers)


def _error_handlers() -> dict[type[Exception], ExceptionHandler]:
    return {ApiError: _api_error, StarletteHTTPException: _http_error}


class CatchAll:
    """Any exception no handler turned into a response becomes a 500 in the called API's shape (never
    plain text, never a reset connection), logged with its route template and traceback but without
    its message (it may hold request values). A door's own calls are recorded as failed steps by
    `proxy.http.door` before the exception gets here."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            log_exception(f"{scope.get('method')} {_route_template(scope)}", e)
            if started:  # mid-body: nothing more can be said; the response ends here
                return
            response = error_response(flavor_for_path(scope["path"]), 500, "internal error in the proxy")
            await response(scope, receive, send)


def _route_template(scope: Scope) -> str:
    """The route's path template ("/atdp/v1/sessions/{session_id}"), not the path the client sent."""
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", "?"))
    return "(no route)"


def _healthz(state: AppState, swaps: Versions, ner: NerStatus) -> Endpoint:
    async def healthz(request: Request) -> Response:
        r = state.recorder
        bus = swaps.bus
        writer = r.health().judge(state.settings.writer_lag_s)
        # Not ok (503) while steps could be lost or are not being made durable: a dead, lagging or
        # failing writer. A database that is away is not a problem here: the spool takes the steps.
        return json_response({
            "status": "unavailable" if writer.problems else "ok",
            "problems": writer.problems,
            "worker": state.settings.worker,  # which of `atdp serve --workers N` answered (0: a single proxy)
            "database": bool(state.factory is not None and r.db_ok),
            # Following other proxies' swaps (proxy.rollout.swapbus); null when ATDP_SHARED_SWAPS is off.
            "swap_listener": bus.ready.is_set() if bus is not None else (False if state.settings.shared_swaps else None),
            # Continuation links (proxy.store.links): shared while other proxies are on the database
            # (peers: those counted at the last look; null with ATDP_SHARED_LINKS=0).
            "links": None if state.links is None else {
                "shared": state.links.shared, "peers": state.presence.peers if state.presence is not None else None},
            "writer": writer.as_json(),
            "writer_pending": writer.held,
            # Serving goes on without the NER model, but names and places are then stored as sent.
            "redaction": {"ner": ner.as_json()},
            # What grows with traffic, each bounded (entries; tokens for the token memory): a soak's
            # RSS is read beside these (bench/soak.py).
            "memory": {"rss_mb": round(memtrace.rss_mb() or 0.0, 1),
                       "caches": {**state.index.sizes(), **state.tokens.sizes(), "canary_arms": len(state.canary)},
                       "bounds": {"continuations": state.index.max_entries, "tito_tokens": state.tokens.max_tokens}},
            "spool_pending": r.spool.pending(),
            # Replicas by scheme://host:port only: their URLs may carry credentials.
            "replicas": [{"url": x.label, "alive": x.alive, "open": x.is_open, "version": x.version,
                          "inflight": x.inflight} for x in state.pool.replicas],
        }, status=503 if writer.problems else 200)

    return healthz


def _openapi() -> Endpoint:
    body = orjson.dumps(openapi.document())  # built once: it depends on no request

    async def openapi_json(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return openapi_json


def _metrics(state: AppState) -> Endpoint:
    async def metrics(request: Request) -> Response:
        body = telemetry.render_metrics(state.recorder, state.settings.writer_lag_s)
        return Response(body, media_type="text/plain; version=0.0.4")

    return metrics


def _warm_index(state: AppState) -> None:
    """Re-learn recent transcripts from the database, so continuation survives a restart."""
    assert state.factory is not None
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


def _connect_database(state: AppState, swaps: Versions, loop: asyncio.AbstractEventLoop) -> None:
    """Find (or start) the database, migrate it, load keys and warm the index; then the versions'
    start-up (it talks to the replicas: a task on the event loop, `loop`). Retries in the background."""
    settings = state.settings
    while True:
        try:
            url = db.database_url(settings)
            db.upgrade(url)
            if settings.shared_links is not False or settings.continuation_lookup:
                _connect_links(state, url)
            if settings.shared_swaps:
                swaps.bus = SwapBus(url, state.pool, drain_timeout_s=settings.swap_drain_timeout_s)
                # A canary begun on another proxy routes here too, and this proxy monitors it (standby).
                canarybus.attach(state, swaps, lambda ref: canary.start_monitor(state, swaps, ref))
                follower = admin.ForgetFollower(state)  # a forget run elsewhere is applied here too
                swaps.bus.handlers["forget"] = follower.on_note
                swaps.bus.handlers["policy"] = follower.on_policy
                swaps.bus.handlers["serving"] = swaps.on_serving  # another proxy's promotion
                swaps.bus.on_connect.append(swaps.read_serving)
                swaps.bus.on_connect.append(follower.on_connect)
                state.bus_id = swaps.bus.me
            engine = db.make_engine(url)
            state.engine = engine
            state.factory = db.session_factory(engine)
            state.canary.factory = state.factory
            state.layers.factory = state.factory
            if isinstance(state.recorder, WriterProcess):
                state.recorder.connect(url, state.factory)  # the child makes its own writer engine
            else:  # the in-process writer plans as the child does (proxy.store.db: custom plans, no seq scans)
                if state.writer_engine is not None:  # an earlier attempt that failed after making it
                    state.writer_engine.dispose()
                state.writer_engine = db.make_engine(url, custom_plans=True, pool_size=2, max_overflow=2)
                with state.writer_engine.connect():  # connected now, not on the first step's write
                    pass
                state.recorder.connect(url, db.session_factory(state.writer_engine))
            state.load_keys()
            _warm_index(state)
            swaps.starting = asyncio.run_coroutine_threadsafe(swaps.start_up(), loop)
            log.info("database ready")
            return
        except Exception as e:
            if state.stopping.is_set():
                return
            log.warning("database not ready (%s: %s); serving anyway, steps go to the spool", type(e).__name__, e)
            if state.stopping.wait(2.0):
                return


def _connect_links(state: AppState, url: str) -> None:
    """The continuation keys' store; unless ATDP_SHARED_LINKS=0, this proxy's presence, counted
    before the store serves any call (shared from its first call when other proxies are there)."""
    settings = state.settings
    if state.links is not None:  # an earlier attempt that failed later on
        return
    links = LinkStore(url, ttl_s=settings.session_ttl_s, timeout_s=settings.shared_timeout_s,
                      shared=settings.shared_links is True, may_share=settings.shared_links is not False,
                      read_steps=settings.continuation_lookup)
    if settings.shared_links is not False:
        # A forget drops the keys kept for a switch too (the index's own go in admin.forget_here).
        state.forget_hooks.append(lambda tenant, steps, whole_tenant: links.forget(steps))
        presence = Presence(links, forced=settings.shared_links is True)
        state.presence = presence  # started on the event loop (_start_presence)
        if not presence.ready.wait(presence.handshake_s + 10.0):
            log.warning("other proxies on the database not counted yet; links start %s",
                        "shared" if links.shared else "lone")
    state.links = links


async def _start_presence(state: AppState) -> None:
    while state.presence is None:
        if state.stopping.is_set():
            return
        await asyncio.sleep(0.02)  # (the database thread waits for its first count meanwhile)
    state.presence.start()


async def _start_swap_bus(state: AppState, swaps: Versions) -> None:
    """Follow other proxies' swaps once the database is there (proxy.rollout.swapbus)."""
    while swaps.bus is None:
        if state.stopping.is_set():
            return
        await asyncio.sleep(0.05)
    swaps.bus.start()


async def _partition_upkeep(state: AppState, every_s: float = 6 * 3600.0) -> None:
    """Day partitions exist a week ahead (proxy.store.partitions; start-up makes them too): a proxy
    that runs for weeks keeps making them, retention job or not. Idempotent across proxies."""
    while not state.stopping.is_set():
        await asyncio.sleep(every_s)
        if state.factory is None:
            continue
        try:
            await run_db(state, partitions.ensure)
        except Exception as e:  # the database is away: next round
            log.warning("day partitions not checked (%s)", db.db_error_reason(e))


async def _purge_links(state: AppState) -> None:
    """Continuation keys live as long as the session window (every proxy purges; it is idempotent)."""
    while not state.stopping.is_set():
        await asyncio.sleep(600.0)
        if state.links is not None:
            try:
                await state.links.purge()
            except Exception as e:  # the database is away: next round
                log.warning("continuation keys not purged (%s)", e)


async def _refresh_keys(state: AppState) -> None:
    while not state.stopping.is_set():
        await asyncio.sleep(5.0)
        if state.factory is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(state.load_keys)


