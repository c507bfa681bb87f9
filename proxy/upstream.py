"""The one seam to the engines: the vLLM replicas, choosing one per session, skipping dead ones,
failing over, the upstream auth header and the swap gate. The HTTP calls themselves, and
`UpstreamError` for every upstream failure, are proxy.engine's.

Each replica has a gate. In a `drain` swap its gate is closed: new calls wait (bounded) or go to
another open replica, and the swap starts only once the replica's in-flight calls have drained, so
every call runs entirely under one weight version. In a `keep` swap the gate stays open and the
engine holds its running requests across the update; each replica then counts its swap windows, and
a call whose generation overlapped one reports the versions before and after (`Lease.window`)
instead of claiming one version it cannot know.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from proxy.engine import UpstreamError, public_url

T = TypeVar("T")


class NoReplicaAvailable(Exception):
    """Every replica is dead, or held by a swap for longer than the hold timeout."""


class ReplicaFailed(Exception):
    """One replica failed one attempt; `failover` tries the next."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class Replica:
    url: str
    version: str = "base"
    inflight: int = 0
    dead_until: float = 0.0  # monotonic time before which we don't try it again
    failures: int = 0
    draining_until: float = 0.0  # monotonic end of a swap's wait for this replica's in-flight calls
    # Keep-mode swap windows (proxy.rollout.swap): how many began, whether one is open now, and the
    # versions on either side of the latest one. A window opens before the engine pauses and closes
    # once `version` names the new weights.
    swap_epoch: int = 0
    in_swap: bool = False
    previous_version: str | None = None
    next_version: str | None = None
    # Whether the engine serves the one-request weight update (proxy.rollout.engine_weights); None:
    # not asked yet.
    update_route: bool | None = None
    _open: asyncio.Event = field(default_factory=asyncio.Event)
    _drained: asyncio.Event = field(default_factory=asyncio.Event)

    _label: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        self._open.set()
        self._label = public_url(self.url)  # read on every call; the URL never changes
        self._drained.set()

    @property
    def label(self) -> str:
        """What health, metrics, errors and logs show of this replica (never its credentials)."""
        return self._label

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def alive(self) -> bool:
        return time.monotonic() >= self.dead_until

    def close_gate(self) -> None:
        """New calls wait (or go to another open replica); another proxy is swapping this replica."""
        self._open.clear()

    def open_gate(self) -> None:
        self._open.set()

    async def drained(self, timeout_s: float) -> None:
        """Wait until no call of this process is in flight on the replica (TimeoutError after `timeout_s`)."""
        await asyncio.wait_for(self._drained.wait(), timeout_s)

    def begin_window(self, target: str | None) -> None:
        """A keep-mode swap to `target` is about to pause the engine: calls in flight may span it."""
        self.swap_epoch += 1
        self.in_swap = True
        self.previous_version, self.next_version = self.version, target

    def end_window(self, version: str | None = None) -> None:
        """The engine serves `version` (when given) and no update is under way."""
        if version:
            self.version = version
        self.in_swap = False

    def mark_dead(self, seconds: float = 2.0) -> None:
        self.failures += 1
        # Back off longer for a replica that keeps failing, up to 30 s.
        self.dead_until = time.monotonic() + min(30.0, seconds * 2 ** min(self.failures - 1, 4))

    def mark_alive(self) -> None:
        self.failures = 0
        self.dead_until = 0.0


@dataclass
class Lease:
    """A call's hold on a replica; `version` is what the replica served when the call entered."""

    replica: Replica
    version: str
    epoch: int = 0  # the replica's swap_epoch at entry
    entered_in_swap: bool = False  # entered while a keep-mode update was under way
    before: str | None = None  # the version served before that update

    def window(self) -> tuple[str, str] | None:
        """(before, after) when a keep-mode swap overlapped the call so far, else None: its tokens
        may come from either version. Asked once the output is read: a window that began before the
        last token did was counted before the engine paused, so it is never missed (a window that
        began just after only makes the answer conservative)."""
        r = self.replica
        if not self.entered_in_swap and r.swap_epoch == self.epoch:
            return None
        return self.before or self.version, (r.next_version if r.in_swap and r.next_version else r.version)


class ReplicaPool:
    def __init__(self, urls: list[str], *, hold_timeout_s: float = 60.0, api_key: str | None = None) -> None:
        if not urls:
            raise ValueError("at least one upstream URL is needed")
        self.replicas = [Replica(url=u.rstrip("/")) for u in urls]
        self.hold_timeout_s = hold_timeout_s
        # vLLM started with --api-key wants it on every route, model traffic and control alike.
        self.auth_headers: dict[str, str] = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def ranked(self, key: str) -> list[Replica]:
        """Rendezvous hashing: a stable preference order per session key (prefix-cache locality)."""
        if len(self.replicas) == 1:
            return list(self.replicas)

        def score(r: Replica) -> bytes:
            return hashlib.blake2b(f"{key}|{r.url}".encode(), digest_size=8).digest()

        return sorted(self.replicas, key=score, reverse=True)

    def candidates(self, key: str) -> Iterator[Replica]:
        """Alive replicas in preference order; dead ones last (they may have come back)."""
        ranked = self.ranked(key)
        yield from (r for r in ranked if r.alive)
        yield from (r for r in ranked if not r.alive)

    async def acquire(self, replica: Replica) -> Lease:
        """Enter a replica's gate (waiting while it swaps) and count the call in flight."""
        if not replica.is_open:
            # A swap first waits (up to its drain timeout) for the replica's in-flight calls, then
            # reloads. A call held at the gate waits out that drain too, plus the hold timeout for
            # the reload: a long call that delays the swap, or makes it give up (the gate then
            # reopens on the old version), never fails the calls queued behind it.
            timeout = self.hold_timeout_s + max(0.0, replica.draining_until - time.monotonic())
            try:
                await asyncio.wait_for(replica._open.wait(), timeout)
            except TimeoutError:
                raise NoReplicaAvailable(f"{replica.label} is swapping weights; held too long") from None
        replica.inflight += 1
        replica._drained.clear()
        return Lease(replica=replica, version=replica.version, epoch=replica.swap_epoch,
                     entered_in_swap=replica.in_swap,
                     before=replica.previous_version if replica.in_swap else replica.version)

    def release(self, lease: Lease) -> None:
        r = lease.replica
        r.inflight -= 1
        if r.inflight == 0:
            r._drained.set()

    def pick_open(self, key: str, exclude: set[str]) -> Replica | None:
        """The preferred replica not yet tried; an open one first so a swap elsewhere doesn't hold us."""
        options = [r for r in self.candidates(key) if r.url not in exclude]
        if not options:
            return None
        for r in options:
            if r.is_open and r.alive:
                return r
        return options[0]

    @asynccontextmanager
    async def swapping(self, replica: Replica, drain_timeout_s: float):
        """Close the gate, wait for in-flight calls to finish, run the swap body, reopen."""
        replica._open.clear()
        replica.draining_until = time.monotonic() + drain_timeout_s
        try:
            try:
                await asyncio.wait_for(replica._drained.wait(), drain_timeout_s)
            finally:
                replica.draining_until = 0.0
            yield replica
        finally:
            replica._open.set()


async def failover(pool: ReplicaPool, key: str, attempt: Callable[[Replica], Awaitable[T]],
                   group: frozenset[str] | None = None) -> T:
    """`attempt` on the preferred replica for `key`, then on the next while one raises ReplicaFailed.

    `group` (public labels; a canary's arm, proxy.canary) restricts the call to those replicas first;
    only when every one of them failed does it go to the others (the step then records the version
    that really served it: availability over stickiness).
    Raises UpstreamError (the last failure's status, 503 when no replica is configured or open).
    """
    outside = {r.url for r in pool.replicas if r.label not in group} if group else set()
    tried: set[str] = set(outside)
    last, status = "no upstream replica configured", 503
    while True:
        replica = pool.pick_open(key, tried)
        if replica is None and outside:  # the group is exhausted: the others, as a last resort
            tried -= outside
            outside = set()
            replica = pool.pick_open(key, tried)
        if replica is None:
            break
        tried.add(replica.url)
        try:
            return await attempt(replica)
        except ReplicaFailed as e:
            last, status = e.message, e.status
    raise UpstreamError(status, f"upstream unavailable: {last}")


def upstream_error(status: int, body: bytes) -> dict[str, Any]:
    """A failed upstream answer as the step's error record: vLLM's own message when it sent one."""
    try:
        parsed = orjson.loads(body)
        message = (parsed.get("error") or {}).get("message") if isinstance(parsed.get("error"), dict) else parsed.get("message")
    except Exception:
        message = None
    return {"type": "upstream_error", "message": message or body[:500].decode(errors="replace"), "status_code": status}
