"""The encrypted store behind `previous_response_id` (the Responses door's conversations).

Served responses are kept (unless `store: false`) so a later `previous_response_id` continues the
conversation. The conversation is needed verbatim for that, so it is sealed with AES-256-GCM under
a key derived from the deployment secret, bound to its tenant and id, and expires. Sealing happens
on a background thread, which hands the sealed row to the recorder: it travels the steps' durable
path (held until the writer acknowledges it, spooled while the database is away), so an outage of
any length does not drop it. A small in-memory LRU answers the usual immediate follow-up without
a database read.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import select

from proxy.errors import ApiError
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.write import SealedResponse

log = logging.getLogger("atdp.responses")


DEFAULT_TTL_S = 30 * 24 * 3600.0


_HKDF_INFO = b"atdp/stored_responses/v1"


@dataclass
class Stored:
    tenant: str
    step_id: str | None
    items: list[Any]  # input items (with their own history) + output items: the next call's history
    expires_at: datetime
    kept_at: float = 0.0  # monotonic time it entered the in-memory LRU


class Sealer:
    """AES-256-GCM with a key derived (HKDF-SHA256) from the deployment secret.

    The associated data binds a sealed blob to its tenant and response id: a row copied to another
    tenant or id does not open.
    """

    def __init__(self, secret: bytes) -> None:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(secret)
        self._aead = AESGCM(key)

    @staticmethod
    def _aad(tenant: str, response_id: str) -> bytes:
        return tenant.encode() + b"\x00" + response_id.encode()

    def seal(self, tenant: str, response_id: str, items: list[Any]) -> bytes:
        nonce = os.urandom(12)
        plain = zlib.compress(orjson.dumps(items), 1)  # conversations repeat a lot; level 1 is fast
        return nonce + self._aead.encrypt(nonce, plain, self._aad(tenant, response_id))

    def open(self, tenant: str, response_id: str, sealed: bytes) -> list[Any]:
        plain = self._aead.decrypt(sealed[:12], sealed[12:], self._aad(tenant, response_id))
        return orjson.loads(zlib.decompress(plain))


class ResponseStore:
    """Recent responses in memory (LRU), all of them sealed in `stored_responses` (written off-path)."""

    def __init__(self, state: AppState, *, ttl_s: float = DEFAULT_TTL_S, max_recent: int = 2048, recent_s: float = 600.0,
                 queue_size: int = 10_000) -> None:
        self.state = state
        self.ttl_s = ttl_s
        # Memory answers only the next few minutes' follow-ups; later ones read the database, so a
        # `forget` (which deletes rows) is not outlived by a cached copy for long.
        self.recent_s = recent_s
        self.sealer = Sealer(state.settings.secret)
        self.max_recent = max_recent
        self._recent: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, Stored] | None] = queue.Queue(queue_size)
        self._thread: threading.Thread | None = None
        # Steps forgotten while their conversation may still wait here to be sealed: never sealed.
        self._gone: set[str] = set()
        self._gone_tenants: dict[str, float] = {}  # tenant -> when it was forgotten whole (monotonic)
        state.forget_hooks.append(self.forget)

    def forget(self, tenant: str, step_ids: set[str], whole_tenant: bool) -> None:
        """A forget: drop the recent conversations of the forgotten steps (or tenant), so no later
        `previous_response_id` continues them from memory, and never seal those still queued."""
        with self._lock:
            for rid in [rid for rid, st in self._recent.items()
                        if st.tenant == tenant and (whole_tenant or st.step_id in step_ids)]:
                del self._recent[rid]
            if len(self._gone) > 100_000:  # queued items live seconds; old ids need not stay
                self._gone.clear()
            self._gone.update(step_ids)
            if whole_tenant:
                self._gone_tenants[tenant] = time.monotonic()

    def _forgotten(self, st: Stored) -> bool:
        with self._lock:
            whole = self._gone_tenants.get(st.tenant)
            return (st.step_id is not None and st.step_id in self._gone) or (whole is not None and st.kept_at <= whole)

    # request path: memory only

    def put(self, response_id: str, stored: Stored) -> None:
        stored.kept_at = time.monotonic()
        with self._lock:
            self._recent[response_id] = stored
            self._recent.move_to_end(response_id)
            while len(self._recent) > self.max_recent:
                self._recent.popitem(last=False)
        self._ensure_thread()
        try:
            self._queue.put_nowait((response_id, stored))
        except queue.Full:  # the sealing thread is far behind: seal this one here rather than drop it
            self._write([(response_id, stored)])

    def recent(self, tenant: str, response_id: str) -> Stored | None:
        with self._lock:
            hit = self._recent.get(response_id)
        if hit is None or hit.tenant != tenant or hit.kept_at < time.monotonic() - self.recent_s:
            return None
        return hit

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """A stored response of this tenant; None when unknown, expired or another tenant's."""
        hit = self.recent(tenant, response_id)
        if hit is not None:
            return hit
        if self.state.factory is None:
            raise ApiError(503, "cannot look up previous_response_id: the database is unavailable")
        found = await asyncio.to_thread(self._load, tenant, response_id)
        # Another proxy on this database may have served it a moment ago, its sealed row still on
        # the way through its writer: a miss waits for it (bounded), so only a 404 pays the wait.
        links = self.state.links
        deadline = time.monotonic() + (self.state.settings.response_wait_s if links is not None and links.shared else 0.0)
        delay = 0.01
        while found is None and time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
            found = await asyncio.to_thread(self._load, tenant, response_id)
        return found

    # database side: a background thread

    def _load(self, tenant: str, response_id: str) -> Stored | None:


        with self.state.factory() as s:
            row = s.execute(select(t.StoredResponse).where(
                t.StoredResponse.id == response_id, t.StoredResponse.tenant_id == tenant)).scalar_one_or_none()
        if row is None:
            return None
        expires = row.expires_at.replace(tzinfo=UTC) if row.expires_at and row.expires_at.tzinfo is None else row.expires_at
        if expires is not None and expires <= datetime.now(UTC):
            return None
        try:
            items = self.sealer.open(tenant, response_id, row.sealed)
        except Exception:  # a different secret, or a tampered row: it cannot continue anything
            log.warning("stored response %s does not open", response_id)
            return None
        return Stored(tenant=tenant, step_id=row.step_id, items=items,
                      expires_at=expires or datetime.now(UTC) + timedelta(seconds=self.ttl_s))

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="atdp-response-store", daemon=True)
                    self._thread.start()
                    atexit.register(self.close)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch = [first]
            while len(batch) < 256:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if b is not None]
            if items:
                self._write(items)
            for _ in batch:
                self._queue.task_done()
            if None in batch:
                return

    def _write(self, batch: list[tuple[str, Stored]]) -> None:
        for rid, st in batch:
            if self._forgotten(st):
                continue
            self.state.recorder.submit(SealedResponse(id=rid, tenant_id=st.tenant, step_id=st.step_id,
                                                      sealed=self.sealer.seal(st.tenant, rid, st.items),
                                                      expires_at=st.expires_at))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything put so far is sealed and durable (written or spooled by the writer)."""
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            done = threading.Event()

            def wait() -> None:
                self._queue.join()
                done.set()

            threading.Thread(target=wait, daemon=True).start()
            if not done.wait(timeout):
                return False
        return self.state.recorder.flush(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.flush(5.0)
            self._queue.put(None)
