"""Which proxies are on the database, so that continuation links are shared exactly while several are.

A proxy whose links may be shared (ATDP_SHARED_LINKS unset, or 1) holds, on a connection of its own,
a shared advisory lock PRESENT for as long as it runs; while its links are shared it also holds
SHARING. PostgreSQL lists every holder in `pg_locks` (per database) and drops a lock with its
connection, so a proxy that stops or dies stops counting at once (a host that vanishes: once its
server sees the connection gone). No table, no heartbeat writes.

- Start: take PRESENT, announce it (NOTIFY on `atdp_presence`), count the other holders. With
  others, the links turn shared, and the proxy waits (at most `handshake_s`) until each of them holds
  SHARING before it reports ready: by then they publish their keys, and have published those of the
  steps they served lately (`LinkStore.go_shared`).
- Running: every proxy LISTENs on that channel and counts again when a peer announces itself (a
  round trip after the peer connected), and every `check_s` anyway (a missed announcement, a peer
  gone). A proxy alone for `linger_s` turns its links lone again.

ATDP_SHARED_LINKS=1 holds both locks from the start and never turns lone; =0 takes no part (its
proxy is not counted, and publishes nothing, so it links only what it serves or finds stored).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import psycopg

from proxy.store.db import db_error_reason
from proxy.store.links import LinkStore

log = logging.getLogger("atdp.presence")

CHANNEL = "atdp_presence"
# Two-key advisory locks (pg_locks: classid = the namespace, objid = the key, objsubid = 2), apart
# from the swap bus's one-key locks.
NAMESPACE = 0x61746470  # "atdp"
PRESENT, SHARING = 1, 2

_PEERS = f"""
SELECT objid::int8, count(*)::int FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 2 AND classid = {NAMESPACE}::oid AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND pid <> pg_backend_pid()
GROUP BY objid
"""


class Presence:
    """This proxy's presence on the database; switches `links` between lone and shared."""

    def __init__(self, links: LinkStore, *, forced: bool = False, check_s: float = 1.0, linger_s: float = 30.0,
                 handshake_s: float = 2.0, publish_timeout_s: float = 5.0) -> None:
        self.links = links
        self.forced = forced  # ATDP_SHARED_LINKS=1: shared whatever the count
        self.check_s = check_s
        self.linger_s = linger_s
        self.handshake_s = handshake_s
        self.publish_timeout_s = publish_timeout_s
        self.peers = 0  # other proxies on the database, at the last count
        self.ready = threading.Event()  # the first count (and handshake) done: start-up waits for it
        self._last_peer = float("-inf")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="atdp-presence")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        while True:
            conn = None
            try:
                conn = await psycopg.AsyncConnection.connect(self.links.url, autocommit=True, connect_timeout=5)
                await conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (NAMESPACE, PRESENT))
                if self.links.shared:
                    await conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (NAMESPACE, SHARING))
                await conn.execute(f"LISTEN {CHANNEL}")
                await conn.execute("SELECT pg_notify(%s, 'present')", (CHANNEL,))
                await self._check(conn, starting=True)
                self.ready.set()
                while True:
                    # Count again on an announcement (a proxy came, or shares now), else every check_s.
                    # (stop_after, not a break: the generator holds the connection's lock until it ends.)
                    async for _ in conn.notifies(timeout=self.check_s, stop_after=1):
                        pass
                    await self._check(conn)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the mode stays as it is until the count can be taken again
                log.warning("other proxies on the database not counted (%s); links stay %s", db_error_reason(e),
                            "shared" if self.links.shared else "lone")
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
            self.ready.set()  # start-up goes on without the count
            await asyncio.sleep(2.0)

    async def _count(self, conn: psycopg.AsyncConnection) -> tuple[int, int]:
        rows = dict(await (await conn.execute(_PEERS)).fetchall())
        return rows.get(PRESENT, 0), rows.get(SHARING, 0)

    async def _check(self, conn: psycopg.AsyncConnection, *, starting: bool = False) -> None:
        present, _ = await self._count(conn)
        now = time.monotonic()
        self.peers = present
        if present:
            self._last_peer = now
        if self.forced:
            pass
        elif present and not self.links.shared:
            await self._share(conn)
        elif not present and self.links.shared and now - self._last_peer >= self.linger_s:
            self.links.go_lone()
            await conn.execute("SELECT pg_advisory_unlock_shared(%s, %s)", (NAMESPACE, SHARING))
            log.info("no other proxy on the database for %.0f s: continuation links are this proxy's alone",
                     self.linger_s)
        if starting and present:
            await self._handshake(conn)

    async def _share(self, conn: psycopg.AsyncConnection) -> None:
        published = self.links.go_shared()
        if published is not None:  # the recent keys first: a peer that sees SHARING may rely on them
            try:
                await asyncio.wait_for(asyncio.shield(published), self.publish_timeout_s)
            except TimeoutError:
                log.warning("recent continuation keys not published within %.1f s", self.publish_timeout_s)
        await conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (NAMESPACE, SHARING))
        await conn.execute("SELECT pg_notify(%s, 'sharing')", (CHANNEL,))
        log.info("another proxy is on the database: continuation links shared")

    async def _handshake(self, conn: psycopg.AsyncConnection) -> None:
        """Wait (bounded) until every other proxy shares its links: they heard of this one."""
        deadline = time.monotonic() + self.handshake_s
        while True:
            present, sharing = await self._count(conn)
            if sharing >= present:
                return
            if time.monotonic() >= deadline:
                log.warning("%d of %d other proxies do not share links yet; serving anyway", present - sharing,
                            present)
                return
            await asyncio.sleep(0.02)
