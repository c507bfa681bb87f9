"""Continuation keys in PostgreSQL: what lets several proxies link one client's calls.

Each proxy answers continuation from its own memory (`proxy.sessions.ContinuationIndex`); the
`continuation_links` table is the truth they share. The proxy that served a step publishes its keys
before the client has the last bytes of the answer, so the client's next call finds them whichever
proxy it reaches; a proxy whose memory misses reads them here (one indexed read).

Publishing is a group commit on one connection with `synchronous_commit = off`: calls that finish
together share one INSERT, and none waits for a disk flush (a key lost to a database crash only
splits a session in two, as before this table existed; the steps themselves go through the writer's
durable path). Both sides are bounded by `timeout_s`: a slow or absent database costs a call at most
that, and the proxy falls back to what it alone saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import psycopg
from sqlalchemy.engine import make_url

log = logging.getLogger("atdp.links")

_PUBLISH = """
INSERT INTO continuation_links (hash, kind, step_id, session_id, parent_step_id, history_len)
SELECT * FROM unnest(%s::varchar[], %s::varchar[], %s::varchar[], %s::varchar[], %s::varchar[], %s::int[])
ON CONFLICT (hash, kind) DO UPDATE SET step_id = EXCLUDED.step_id, session_id = EXCLUDED.session_id,
  parent_step_id = EXCLUDED.parent_step_id, history_len = EXCLUDED.history_len, created_at = now()
"""

_LOOKUP = """
SELECT hash, kind, step_id, session_id, parent_step_id, history_len FROM continuation_links
WHERE hash = ANY(%s::varchar[]) AND created_at > now() - make_interval(secs => %s)
"""


@dataclass(frozen=True)
class LinkRow:
    hash: str
    kind: str  # "t": input + output (the next call starts with it); "i": the input alone
    step_id: str
    session_id: str  # the session's public id
    parent_step_id: str | None = None
    history_len: int = 0


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL (`postgresql+psycopg://...`) as libpq reads it."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class LinkStore:
    """Publish and look up continuation keys; one writer connection, a few reader connections."""

    def __init__(self, url: str, *, ttl_s: float, timeout_s: float = 0.5, readers: int = 4) -> None:
        self.url = libpq_url(url)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.readers = readers
        self._pending: list[tuple[list[LinkRow], asyncio.Future[bool]]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.Queue[psycopg.AsyncConnection] | None = None
        self._opened = 0
        self.failures = 0  # publishes or lookups that failed or timed out (the call went on without them)
        self.lookups = 0  # reads on the request path (calls whose parent this proxy's memory did not know)

    async def _connect(self) -> psycopg.AsyncConnection:
        conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True, connect_timeout=5)
        await conn.execute("SET synchronous_commit = off")
        return conn

    # publishing: group commit

    def publish(self, rows: list[LinkRow]) -> asyncio.Future[bool]:
        """Queue `rows`; the future is True once they are committed (False when that failed)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((rows, fut))
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._write_loop(), name="atdp-links-publish")
        assert self._wake is not None
        self._wake.set()
        return fut

    async def _write_loop(self) -> None:
        assert self._wake is not None
        conn: psycopg.AsyncConnection | None = None
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._pending = self._pending, []
                if not batch:
                    continue
                # One row per key (the latest wins, as in memory): an upsert may not touch a row twice.
                rows = list({(r.hash, r.kind): r for rs, _ in batch for r in rs}.values())
                ok = True
                try:
                    if conn is None or conn.closed:
                        conn = await self._connect()
                    await conn.execute(_PUBLISH, (
                        [r.hash for r in rows], [r.kind for r in rows], [r.step_id for r in rows],
                        [r.session_id for r in rows], [r.parent_step_id for r in rows], [r.history_len for r in rows]))
                except (psycopg.Error, OSError) as e:
                    ok = False
                    self.failures += len(batch)
                    log.warning("continuation keys not published (%s): other proxies may split these sessions", e)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(ok)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    async def settle(self, fut: asyncio.Future[bool]) -> bool:
        """Wait (bounded) for a publish; the answer goes out either way."""
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            self.failures += 1
            return False

    # looking up

    async def lookup(self, hashes: list[str]) -> list[LinkRow]:
        """The stored keys among `hashes` (within the session window); [] when the database fails."""
        if not hashes:
            return []
        self.lookups += 1
        try:
            return await asyncio.wait_for(self._lookup(hashes), self.timeout_s)
        except (TimeoutError, psycopg.Error, OSError) as e:
            self.failures += 1
            log.warning("continuation keys not read (%s): linking from this proxy's memory only", e)
            return []

    async def _lookup(self, hashes: list[str]) -> list[LinkRow]:
        if self._idle is None:
            self._idle = asyncio.Queue()
        if self._idle.empty() and self._opened < self.readers:
            self._opened += 1
            try:
                conn = await self._connect()
            except BaseException:
                self._opened -= 1
                raise
        else:
            conn = await self._idle.get()
        broken = False
        try:
            cur = await conn.execute(_LOOKUP, (hashes, self.ttl_s))
            return [LinkRow(*row) for row in await cur.fetchall()]
        except BaseException:
            broken = True
            raise
        finally:
            if broken or conn.closed:
                self._opened -= 1
                with contextlib.suppress(Exception):
                    await conn.close()
            else:
                self._idle.put_nowait(conn)

    async def purge(self) -> int:
        """Delete keys older than the session window; how many went."""
        conn = await self._connect()
        try:
            cur = await conn.execute("DELETE FROM continuation_links WHERE created_at < now() - make_interval(secs => %s)",
                                     (self.ttl_s,))
            return cur.rowcount
        finally:
            await conn.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        while self._idle is not None and not self._idle.empty():
            with contextlib.suppress(Exception):
                await self._idle.get_nowait().close()
