"""A canary's routing on every proxy of one database (gate 3 across proxies; proxy.rollout.swapbus).

The proxy that begins a canary (or concludes it) announces it on the swap channel: `canary` with
the candidate's version id and whether it is now active. Every other proxy then reads the canary
row (proxy.store.canary.active_canary) and routes new sessions by its arms, or stops routing. A
session's arm is a row of `canary_sessions`, written by whichever proxy serves its first call, so
every proxy keeps it on the same arm. When a proxy's listener (re)connects it reads the row again,
in case it missed an announcement. Every proxy that routes a canary runs its monitor (the decision):
the one that began it, one started while it runs (proxy.rollout.canary.resume), and one that heard
of it here. A monitor decides only while it holds the monitor lock (`sole_monitor`, an advisory
lock), so one decides at a time and another takes over when that proxy goes away, even for good (a
replica scaled down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import psycopg

from proxy.http import run_db
from proxy.rollout.swap import Versions
from proxy.rollout.swapbus import lock_key
from proxy.state import AppState
from proxy.store.canary import CanaryRef, active_canary

log = logging.getLogger("atdp.canary")

OP = "canary"
MONITOR_KEY = lock_key("canary-monitor")


def attach(state: AppState, versions: Versions, monitor: Callable[[CanaryRef], None]) -> None:
    """Follow other proxies' canaries (called once the swap bus exists); `monitor(ref)` starts this
    proxy's monitor of a canary it now routes (proxy.rollout.canary.start_monitor)."""
    bus = versions.bus
    assert bus is not None

    async def on_note(msg: dict) -> None:
        if not msg.get("active"):
            ref = state.canary.active
            if ref is not None and ref.version_id == msg.get("version_id"):
                state.canary.deactivate()
                log.info("canary of %s ended on another proxy: routing stopped here", ref.candidate)
            return
        await sync(state, versions, monitor)

    async def on_connect() -> None:
        await sync(state, versions, monitor)

    bus.handlers[OP] = on_note
    bus.on_connect.append(on_connect)


async def sync(state: AppState, versions: Versions, monitor: Callable[[CanaryRef], None]) -> None:
    """Route by the canary PostgreSQL holds (none: stop routing), and monitor it, unless this proxy
    runs its monitor already (that one owns the canary's end here)."""
    if state.factory is None or (versions.canary_task is not None and not versions.canary_task.done()):
        return
    ref = await run_db(state, active_canary)
    current = state.canary.active
    if ref is None:
        if current is not None:
            state.canary.deactivate()
        return
    if current is None or current.version_id != ref.version_id:
        state.canary.activate(ref, [r.label for r in state.pool.replicas])
        log.info("canary of %s (begun on another proxy) routes new sessions here too", ref.candidate)
    assert state.canary.active is not None
    monitor(state.canary.active)  # waits for the monitor lock: decides if the proxy holding it goes away


async def announce(versions: Versions, version_id: str, *, active: bool) -> None:
    """Tell the other proxies (nothing to do without the swap bus: a single proxy)."""
    if versions.bus is None:
        return
    try:
        await versions.bus.notify({"op": OP, "version_id": version_id, "active": active})
    except Exception as e:  # they read the row again when their listener reconnects
        log.warning("canary announcement not sent (%s: %s)", type(e).__name__, e)


@contextlib.asynccontextmanager
async def sole_monitor(versions: Versions, wanted: Callable[[], bool], every_s: float) -> AsyncIterator[bool]:
    """Hold the monitor lock, trying every `every_s` while `wanted()`; yields whether it is held (a
    single proxy, without the swap bus, always holds it). Let go on leaving."""
    bus = versions.bus
    if bus is None:
        yield True
        return
    conn: psycopg.AsyncConnection | None = None
    try:
        while wanted():
            try:
                conn = await bus.connect()
                if (await (await conn.execute("SELECT pg_try_advisory_lock(%s)", (MONITOR_KEY,))).fetchone())[0]:
                    break
            except (psycopg.Error, OSError) as e:
                log.warning("canary monitor lock not taken (%s)", e)
            if conn is not None:
                await conn.close()
                conn = None
            await asyncio.sleep(every_s)
        yield conn is not None
    finally:
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()  # lets the lock go
