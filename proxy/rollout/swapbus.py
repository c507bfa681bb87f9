"""Swaps across proxies on one database: one driver, every proxy's gate.

Every proxy listens on the `atdp_swaps` channel and, while its gate for a replica is open, holds a
shared advisory lock named after that replica (on a connection of its own). A swap's driver is the
proxy that takes the driver lock (`pg_try_advisory_lock`, for the whole swap; a second swap started
on another proxy meanwhile is refused). For each replica it announces `close` and takes the
replica's lock exclusively: PostgreSQL grants it once every proxy has closed its gate and drained
its calls in flight there (a proxy that dies lets go with its connection). After the reload it
announces `open` with the version to stamp, then lets the lock go; each proxy sets
`replica.version`, reopens its gate and takes its shared lock again. A proxy that misses the `open`
(its listener reconnecting) reopens once no proxy holds the driver lock.

A keep-mode swap (`close` with `keep`: the version it loads) goes the same way but no gate closes
and nothing drains: each proxy opens a swap window on the replica (proxy.upstream.Replica.begin_window)
and lets its shared lock go at once, so the driver's lock is granted only once every proxy knows
that calls in flight there may span the update; `open` closes the window with the new version.

Not covered: a proxy whose listener is not connected (database away at its start) is not counted
and keeps its gate open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable

import orjson
import psycopg

from proxy.errors import ApiError
from proxy.store.links import libpq_url
from proxy.store.notes import CHANNEL
from proxy.upstream import Replica, ReplicaPool

log = logging.getLogger("atdp.swapbus")


def lock_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"atdp-swap|{name}".encode(), digest_size=8).digest(), "big", signed=True)


DRIVER_KEY = lock_key("driver")


class SwapBusy(ApiError):
    """Another proxy is driving a swap: a conflict (409), not a failure of the version asked for."""

    def __init__(self) -> None:
        super().__init__(409, "another proxy is swapping; try again when it is done", type="conflict_error")


class SwapBus:
    def __init__(self, url: str, pool: ReplicaPool, *, drain_timeout_s: float) -> None:
        self.url = libpq_url(url)
        self.pool = pool
        self.drain_timeout_s = drain_timeout_s
        self.me = uuid.uuid4().hex
        self.ready = asyncio.Event()  # listening, every shared lock held
        self._task: asyncio.Task[None] | None = None
        self._locks: psycopg.AsyncConnection | None = None
        self._relock: dict[str, asyncio.Task[None]] = {}
        self._opened: dict[str, asyncio.Event] = {}
        # Other announcements on the channel, by `op` (proxy.rollout.canarybus), and what to do each
        # time the listener (re)connects (it may have missed some).
        self.handlers: dict[str, Callable[[dict], Awaitable[None]]] = {}
        self.on_connect: list[Callable[[], Awaitable[None]]] = []

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="atdp-swapbus")

    async def connect(self) -> psycopg.AsyncConnection:
        """A connection of its own (autocommit) to the bus's database: its session locks are its own."""
        return await self._connect()

    async def _connect(self) -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(self.url, autocommit=True, connect_timeout=5)

    def _replica(self, label: str) -> Replica | None:
        return next((r for r in self.pool.replicas if r.label == label), None)

    # every proxy: follow the driver's announcements

    async def _listen(self) -> None:
        while True:
            listen = None
            try:
                listen = await self._connect()
                self._locks = await self._connect()
                await listen.execute(f"LISTEN {CHANNEL}")
                for r in self.pool.replicas:
                    await self._locks.execute("SELECT pg_advisory_lock_shared(%s)", (lock_key(r.label),))
                self.ready.set()
                for hook in self.on_connect:
                    try:
                        await hook()
                    except Exception as e:
                        log.warning("after connecting: %s (%s)", type(e).__name__, e)
                async for note in listen.notifies():
                    await self._on(orjson.loads(note.payload))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("swap announcements not followed (%s); reconnecting", e)
            finally:
                self.ready.clear()
                for conn in (listen, self._locks):
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
            await asyncio.sleep(2.0)

    async def _on(self, msg: dict) -> None:
        handler = self.handlers.get(msg.get("op", ""))
        if handler is not None:
            if msg.get("from") != self.me:  # this proxy did it already
                try:
                    await handler(msg)
                except Exception as e:
                    log.warning("announcement %s not followed (%s: %s)", msg.get("op"), type(e).__name__, e)
            return
        replica = self._replica(msg.get("replica", ""))
        if replica is None or self._locks is None:
            return
        if msg.get("op") == "close":
            pending = self._relock.pop(replica.label, None)
            if pending is not None:  # the shared lock of the previous swap is taken back first
                await pending
            self._opened[replica.label] = asyncio.Event()
            if msg.get("keep"):
                replica.begin_window(msg["keep"])
                await self._locks.execute("SELECT pg_advisory_unlock_shared(%s)", (lock_key(replica.label),))
                self._relock[replica.label] = asyncio.create_task(self._take_back(replica))
                return
            replica.close_gate()
            try:
                await replica.drained(self.drain_timeout_s)
            except TimeoutError:  # keep the lock: the driver's wait times out and its swap fails
                log.warning("calls on %s still in flight after %.0f s; the swap there fails", replica.label,
                            self.drain_timeout_s)
                replica.open_gate()
                return
            await self._locks.execute("SELECT pg_advisory_unlock_shared(%s)", (lock_key(replica.label),))
            self._relock[replica.label] = asyncio.create_task(self._take_back(replica))
        elif msg.get("op") == "open":
            replica.end_window(msg.get("version"))
            replica.open_gate()
            if ev := self._opened.get(replica.label):
                ev.set()

    async def _take_back(self, replica: Replica) -> None:
        """The shared lock again once the driver announced `open` (it still holds the replica's lock
        then, so this waits for it to let go). Taking it back any sooner could beat the driver's own
        request and leave it waiting. If the driver went away without announcing, reopen anyway."""
        assert self._locks is not None
        opened = self._opened[replica.label]
        while not opened.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(opened.wait(), 1.0)
            if not opened.is_set() and await self._no_driver():
                log.warning("the swap of %s ended without an announcement; reopening with %s", replica.label,
                            replica.version)
                replica.open_gate()
                break
        await self._locks.execute("SELECT pg_advisory_lock_shared(%s)", (lock_key(replica.label),))

    async def _no_driver(self) -> bool:
        assert self._locks is not None
        got = (await (await self._locks.execute("SELECT pg_try_advisory_lock_shared(%s)", (DRIVER_KEY,))).fetchone())[0]
        if got:
            await self._locks.execute("SELECT pg_advisory_unlock_shared(%s)", (DRIVER_KEY,))
        return bool(got)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for task in self._relock.values():
            task.cancel()

    async def notify(self, msg: dict) -> None:
        """Announce `msg` (with an `op` some proxy's handlers know) to every proxy on the database."""
        payload = orjson.dumps({**msg, "from": self.me}).decode()
        conn = await self._connect()
        try:
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
        finally:
            await conn.close()

    # the driver

    @contextlib.asynccontextmanager
    async def driving(self):
        """Hold the driver lock for a swap; SwapBusy when another proxy holds it, a 503 when the database
        cannot be reached (nothing was touched: the caller may try again)."""
        try:
            conn = await self._connect()
        except psycopg.OperationalError:
            raise ApiError(503, "the database is unavailable, so the swap was not started; try again shortly",
                           headers={"retry-after": "5"}) from None
        try:
            if not (await (await conn.execute("SELECT pg_try_advisory_lock(%s)", (DRIVER_KEY,))).fetchone())[0]:
                raise SwapBusy()
            await conn.execute("SELECT set_config('lock_timeout', %s, false)", (f"{int(self.drain_timeout_s * 1000)}ms",))
            yield Driver(self, conn)
        finally:
            with contextlib.suppress(Exception):
                await conn.close()  # lets every lock of this session go


class Driver:
    def __init__(self, bus: SwapBus, conn: psycopg.AsyncConnection) -> None:
        self.bus, self.conn = bus, conn

    async def _announce(self, op: str, replica: Replica, version: str | None = None, keep: str | None = None) -> None:
        payload = orjson.dumps({"op": op, "replica": replica.label, "version": version, "keep": keep,
                                "from": self.bus.me}).decode()
        await self.conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))

    async def close(self, replica: Replica, keep: str | None = None) -> None:
        """Every proxy's gate for `replica` closed and drained (psycopg error after the drain timeout);
        with `keep` (the version being loaded): every proxy's swap window on it open instead."""
        await self._announce("close", replica, keep=keep)
        await self.conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(replica.label),))

    async def open(self, replica: Replica) -> None:
        """Every proxy stamps `replica.version` and reopens."""
        try:
            await self._announce("open", replica, replica.version)
        finally:
            await self.conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key(replica.label),))
