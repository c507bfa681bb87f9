"""Continuation keys in PostgreSQL: the truth behind each proxy's in-memory index.

Each proxy answers continuation from its own memory (`proxy.sessions.ContinuationIndex`), a cache
bounded by `ATDP_CONTINUATION_ENTRIES`; a call whose parent that memory does not know is looked up
here once (one indexed read). Two modes, by deployment (`shared`; `proxy.store.presence` switches it
while other proxies are on the database, unless ATDP_SHARED_LINKS forces it):

- one proxy (`shared = False`): the stored steps themselves (`steps.transcript_hash`, which the
  writer stores anyway): nothing is written on the request path, and a parent the memory has let go
  of (evicted, or from before a restart) is still found once its step is stored. The keys a shared
  proxy would have published are kept in memory for `recent_s` (the steps' way through the writer),
  so that a switch to shared publishes them: a conversation this proxy served a moment before
  another proxy came is still linked there;
- several proxies (`shared = True`): the `continuation_links` table, and the stored steps as above
  (a step served while its proxy was alone is only there). The proxy that served a step publishes
  its keys before the client has the last bytes of the answer, so the client's next call finds
  them whichever proxy it reaches, before any writer has stored the step.

Publishing is a group commit on one connection with `synchronous_commit = off`: calls that finish
together share one INSERT, and none waits for a disk flush (a key lost to a database crash only
splits a session in two, as before this table existed; the steps themselves go through the writer's
durable path). Both sides are bounded by `timeout_s`: a slow or absent database costs a call at most
that, and the proxy falls back to what it alone saw. A lone proxy remembers the keys the database
did not know for `unknown_ttl_s` (only its own steps, which its memory holds first, could add them),
so a client whose history never matches (it edits or compacts it) costs one read, not one per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict, deque
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

# Several proxies: the published keys and the stored steps' transcripts (those of steps served while
# their proxy was alone), the latest of each key.
_LOOKUP = """
SELECT DISTINCT ON (hash, kind) hash, kind, step_id, session_id, parent_step_id, history_len,
  extract(epoch FROM now() - at)::float8 FROM (
  SELECT hash, kind, step_id, session_id, parent_step_id, history_len, created_at AS at FROM continuation_links
  WHERE hash = ANY(%(hashes)s::varchar[]) AND created_at > now() - make_interval(secs => %(ttl)s)
  UNION ALL
  SELECT st.transcript_hash, 't', st.id, se.external_id, NULL::varchar, 0, st.started_at
  FROM steps st JOIN sessions se ON se.id = st.session_id
  WHERE st.tenant_id = %(tenant)s AND st.transcript_hash = ANY(%(hashes)s::varchar[])
    AND st.started_at > now() - make_interval(secs => %(ttl)s)
) k ORDER BY hash, kind, at DESC
"""

# One proxy: the stored steps' transcripts (hash index ix_steps_transcript_hash, migration 0014); the
# latest step of a hash. The keys are seeded by the tenant (and key, end user) already; naming it is
# defence in depth.
_LOOKUP_STEPS = """
SELECT DISTINCT ON (st.transcript_hash) st.transcript_hash, 't', st.id, se.external_id, NULL::varchar, 0, 0.0::float8
FROM steps st JOIN sessions se ON se.id = st.session_id
WHERE st.tenant_id = %(tenant)s AND st.transcript_hash = ANY(%(hashes)s::varchar[])
  AND st.started_at > now() - make_interval(secs => %(ttl)s)
ORDER BY st.transcript_hash, st.started_at DESC
"""


@dataclass(frozen=True, slots=True)
class LinkRow:
    hash: str
    # "t": input + output (the next call starts with it); "i": the request's fingerprint
    # (`proxy.sessions.body_hash`: a client's retry of it joins its session)
    kind: str
    step_id: str
    session_id: str  # the session's public id
    parent_step_id: str | None = None
    history_len: int = 0
    age_s: float = 0.0  # how long ago it was published (read, not written)


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL (`postgresql+psycopg://...`) as libpq reads it."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class LinkStore:
    """Look up (and, shared, publish) continuation keys; one writer connection, a few readers.

    `may_share`: the mode may turn shared later (proxy.store.presence), so a lone proxy keeps its
    recent keys; `read_steps`: a lone proxy reads the stored steps (ATDP_CONTINUATION_LOOKUP)."""

    def __init__(self, url: str, *, ttl_s: float, timeout_s: float = 0.5, readers: int = 4, shared: bool = True,
                 may_share: bool = False, read_steps: bool = True, unknown_entries: int = 20_000,
                 unknown_ttl_s: float = 300.0, recent_s: float = 60.0, recent_entries: int = 20_000) -> None:
        self.url = libpq_url(url)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.readers = readers
        self.shared = shared
        self.may_share = may_share or shared
        self.read_steps = read_steps
        # A lone proxy's keys of the last `recent_s` (when they were made, the rows), bounded by rows:
        # what a switch to shared publishes (older steps are stored by then, and found there).
        self._recent: deque[tuple[float, list[LinkRow]]] = deque()
        self._recent_rows = 0
        self.recent_s = recent_s
        self.recent_entries = recent_entries
        # Keys looked up and not found: 16-byte digests -> when (bounded by count and age).
        self._unknown: OrderedDict[bytes, float] = OrderedDict()
        self.unknown_entries = unknown_entries
        self.unknown_ttl_s = unknown_ttl_s
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

    # the mode

    def offer(self, rows: list[LinkRow]) -> asyncio.Future[bool] | None:
        """A served step's keys: published when shared (the future, for `settle`), else kept a while
        in case other proxies come (`may_share`; a deque append, the whole cost to a lone proxy)."""
        if self.shared:
            return self.publish(rows)
        if self.may_share:
            now = time.monotonic()
            self._recent.append((now, rows))
            self._recent_rows += len(rows)
            while self._recent and (self._recent_rows > self.recent_entries or self._recent[0][0] < now - self.recent_s):
                self._recent_rows -= len(self._recent.popleft()[1])
        return None

    def go_shared(self) -> asyncio.Future[bool] | None:
        """Other proxies are on the database: publish from now on, starting with the keys of the
        steps served lately (not stored yet, perhaps); None when there are none."""
        self.shared = True
        self._unknown.clear()  # other proxies' steps may hold what this proxy alone could not find
        now = time.monotonic()
        rows = [r for when, rs in self._recent if when >= now - self.recent_s for r in rs]
        self._recent.clear()
        self._recent_rows = 0
        return self.publish(rows) if rows else None

    def forget(self, step_ids: set[str]) -> int:
        """Drop the kept keys of forgotten steps (as their parent too): a later switch must not
        publish them. How many went."""
        n = self._recent_rows
        kept = [(when, [r for r in rs if r.step_id not in step_ids and r.parent_step_id not in step_ids])
                for when, rs in self._recent]
        self._recent = deque((when, rs) for when, rs in kept if rs)
        self._recent_rows = sum(len(rs) for _, rs in self._recent)
        return n - self._recent_rows

    def go_lone(self) -> None:
        """No other proxy any more: nothing is published, lookups read the stored steps."""
        self.shared = False

    # publishing: group commit

    def publish(self, rows: list[LinkRow]) -> asyncio.Future[bool]:
        """Queue `rows`; the future is True once they are committed (False when that failed)."""
        assert self.shared, "a lone proxy's keys are its stored steps: nothing to publish"
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

    async def lookup(self, hashes: list[str], tenant: str) -> list[LinkRow]:
        """The stored keys among `hashes` (within the session window); [] when the database fails.
        A lone proxy does not ask again for keys it did not find a moment ago (`unknown_ttl_s`)."""
        if not self.shared and not self.read_steps:
            return []
        now = time.monotonic()
        ask = [h for h in hashes if not self._known_unknown(h, now)]
        if not ask:
            return []
        self.lookups += 1
        try:
            rows = await asyncio.wait_for(self._lookup(ask, tenant), self.timeout_s)
        except (TimeoutError, psycopg.Error, OSError) as e:
            self.failures += 1
            log.warning("continuation keys not read (%s): linking from this proxy's memory only", e)
            return []
        if self.shared:  # another proxy may publish a key a moment later: ask again next time
            return rows
        found = {r.hash for r in rows}
        for h in ask:
            if h not in found:
                key = _key(h)
                self._unknown[key] = now
                self._unknown.move_to_end(key)
        while self._unknown and (len(self._unknown) > self.unknown_entries
                                 or next(iter(self._unknown.values())) < now - self.unknown_ttl_s):
            self._unknown.popitem(last=False)
        return rows

    def _known_unknown(self, h: str, now: float) -> bool:
        when = self._unknown.get(_key(h))
        return when is not None and when >= now - self.unknown_ttl_s

    async def _lookup(self, hashes: list[str], tenant: str) -> list[LinkRow]:
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
            cur = await conn.execute(_LOOKUP if self.shared else _LOOKUP_STEPS,
                                     {"hashes": hashes, "tenant": tenant, "ttl": self.ttl_s})
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
        """Delete keys older than the session window; how many went (a lone proxy leaves them: the
        next proxy that shares purges them, and no lookup reads them meanwhile)."""
        if not self.shared:
            return 0
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


def _key(h: str) -> bytes:
    return hashlib.blake2b(h.encode(), digest_size=16).digest()
