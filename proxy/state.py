"""The proxy's state: what every route and the lifecycle share, typed, built once by `create_app`."""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request

from proxy import telemetry
from proxy.auth import Principal, active_keys, hash_key, header_map, key_from_headers, lookup_key_hash
from proxy.canary import CanaryRouter
from proxy.config import Settings
from proxy.engine import EngineClient
from proxy.errors import ApiError
from proxy.evolve.snapshot import DiagnosisCache
from proxy.governance.policies import Policies
from proxy.governance.redaction import TextRedactor
from proxy.layers.serving import Layers
from proxy.layers.shadow import ShadowTap
from proxy.providers import RouteTable
from proxy.record.durability import Writer
from proxy.sessions import ContinuationIndex
from proxy.store.links import LinkStore
from proxy.store.presence import Presence
from proxy.tito import TokenMemory
from proxy.upstream import ReplicaPool


@dataclass
class AppState:
    settings: Settings
    policies: Policies
    pool: ReplicaPool
    index: ContinuationIndex
    recorder: Writer  # thread mode: in this process; process mode (default): a child
    redactor: TextRedactor  # for the few texts control routes persist themselves (feedback comments)
    tracer: telemetry.Tracer
    routes: RouteTable = field(default_factory=RouteTable)  # model -> provider (none: every call to vLLM)
    factory: sessionmaker[Session] | None = None  # None until the database is reachable
    engine: Engine | None = None
    writer_engine: Engine | None = None  # thread mode: the in-process writer's own connection
    engine_client: EngineClient | None = None  # every HTTP call to the engines (proxy.engine); set at start-up
    keys: dict[str, Principal] = field(default_factory=dict)  # sha256(key) -> principal
    misses: dict[str, float] = field(default_factory=dict)  # unknown key hashes, to not hammer the DB
    lookups: dict[str, asyncio.Future[Principal | None]] = field(default_factory=dict)  # key lookups under way
    stopping: threading.Event = field(default_factory=threading.Event)  # set when the app shuts down
    diagnosis: DiagnosisCache = field(default_factory=DiagnosisCache)  # snapshots served by the route
    canary: CanaryRouter = field(default_factory=CanaryRouter)  # gate 3's routing; its factory is set on connect
    # Called after a forget with (tenant, forgotten step ids, whole tenant?): caches the doors keep
    # (the Responses door's recent conversations) drop what links to forgotten sessions.
    forget_hooks: list[Callable[[str, set[str], bool], None]] = field(default_factory=list)
    links: LinkStore | None = None  # continuation keys in the database (proxy.store.links); set on connect
    presence: Presence | None = None  # other proxies on the database turn `links` shared (proxy.store.presence)
    tokens: TokenMemory = field(default_factory=TokenMemory)  # served steps' ids, for token-in-token-out
    bus_id: str = ""  # this proxy's id on the notes channel (its own forget notes skip it); '' without one
    layers: Layers = field(default_factory=Layers)  # harness and memory versions that serve; factory set on connect
    shadow: ShadowTap = field(default_factory=ShadowTap)  # live calls offered to shadow gates (proxy.layers.shadow)

    async def authenticate(self, request: Request, *, admin: bool = False, scope: str | None = None) -> Principal:
        """Who calls. `admin`: the route needs the admin key, or a scoped key covering `scope`;
        a scoped key is refused everywhere else (model traffic included)."""
        headers = header_map(request.scope)
        key = key_from_headers(headers)
        s = self.settings
        if key and s.admin_key and hmac.compare_digest(key.encode(), s.admin_key.encode()):
            return Principal(tenant=headers.get("x-atdp-tenant") or s.default_tenant, key_id="admin",
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
                principal = await self._lookup_once(h)
            except ApiError:
                if not s.open_mode:
                    raise
        if principal is None:
            if s.open_mode and not admin:  # local use: clients send placeholder keys; they're the default tenant
                return Principal(tenant=s.default_tenant, key_id=None)
            raise ApiError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        if not principal.may(scope):
            raise ApiError(403, f"this key is scoped to {', '.join(sorted(principal.scopes or ()))}; "
                                "it cannot be used here", type="permission_error")
        if admin and not principal.is_admin and principal.scopes is None:
            raise ApiError(403, "this route needs the admin key", type="permission_error")
        return principal

    async def _lookup_once(self, h: str) -> Principal | None:
        """One database lookup per key at a time: the calls that arrive while it runs (a busy client
        with a placeholder key in open mode, each time its miss expires) wait for the same answer."""
        pending = self.lookups.get(h)
        if pending is None:
            pending = self.lookups[h] = asyncio.ensure_future(self._lookup(h))
            pending.add_done_callback(lambda _: self.lookups.pop(h, None))
        return await asyncio.shield(pending)

    async def _lookup(self, h: str) -> Principal | None:
        factory = self.factory
        if factory is None:
            raise ApiError(503, "cannot verify the API key: the database is unavailable")

        def query() -> Principal | None:
            with factory() as ses:
                return lookup_key_hash(ses, h)

        try:
            principal = await asyncio.wait_for(asyncio.to_thread(query), 3.0)
        except Exception:
            raise ApiError(503, "cannot verify the API key: the database is unavailable") from None
        if principal is None:
            now = time.monotonic()
            if len(self.misses) >= 10_000:  # bounded: expired misses say nothing any more
                self.misses = {k: t for k, t in self.misses.items() if t > now}
            self.misses[h] = now + 2.0
        else:
            self.keys[h] = principal
        return principal

    def load_keys(self) -> None:
        if self.factory is None:
            return
        with self.factory() as ses:
            self.keys = {p_hash: p for p_hash, p in active_keys(ses)}
