"""Versioned hot-swap of every vLLM replica, and rollback's restore path.

A swap goes one replica at a time, in the mode `ATDP_SWAP_MODE` names.
drain: close its gate (new calls wait or go to another open replica), wait until its in-flight
calls drained, run vLLM's dev-mode sequence (pause, reload weights beside a prefix-cache reset,
tag the weight version, resume: proxy.rollout.engine_weights), set `replica.version`, reopen. A
call is stamped with `replica.version` when it enters the gate and no call is in flight while the weights change, so every output token's version is exact.
keep: the gate stays open; every proxy opens a swap window on the replica (proxy.upstream: calls in
flight across it learn they may hold tokens of both versions), then the engine pauses with `keep`,
reloads, is tagged, resumes, and the window closes with the new version stamped.
If any replica fails, every replica already swapped (and the failed one) is reloaded with the
previous checkpoint: the old version keeps serving everywhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from atdp_schema.models import VersionStatus
from proxy import telemetry
from proxy.engine import EngineClient, redact_url_text
from proxy.errors import ApiError
from proxy.governance.tokens import find_tokenizer
from proxy.rollout.engine_weights import (
    SwapError,
    SwapMode,
    from_checkpoint,
    load_weights,
    source_for,
    update,
)
from proxy.rollout.swapbus import Driver, SwapBus
from proxy.state import AppState
from proxy.store import tables as t
from proxy.store.canary import CanaryRef, active_canary
from proxy.store.ids import new_id
from proxy.store.versions import BASE_NAME, VersionRef, serving_version
from proxy.upstream import Replica

log = logging.getLogger("atdp.versions")


class Versions:
    """The proxy's view of versions: what serves now, and the one swap that may run at a time."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.lock = asyncio.Lock()
        self.current: VersionRef | None = None
        self.ready = threading.Event()
        self.drain_timeout_s = state.settings.swap_drain_timeout_s
        self.load_timeout_s = state.settings.swap_load_timeout_s
        self.mode = state.settings.swap_mode
        self.transfer = state.settings.weight_transfer  # disk | nccl (proxy.rollout.engine_weights)
        self.gate_tasks: dict[str, asyncio.Task] = {}  # version id -> its running gates (proxy.rollout.gates)
        self.canary_task: asyncio.Task | None = None  # the running canary's monitor (proxy.rollout.canary)
        self.canary_at_start: CanaryRef | None = None  # the canary running when this proxy started (it resumes it)
        self.bus: SwapBus | None = None  # swaps across the proxies on this database (set on connect)
        self._driver: Driver | None = None  # while this proxy drives a swap
        self.starting: concurrent.futures.Future[None] | None = None  # start-up's task, until it is done

    @contextlib.asynccontextmanager
    async def driving(self) -> AsyncIterator[None]:
        """Be the one proxy on this database that swaps (SwapBusy when another one is)."""
        bus = self.bus
        if bus is None or not bus.ready.is_set() or self._driver is not None:
            yield
            return
        async with bus.driving() as driver:
            self._driver = driver
            try:
                yield
            finally:
                self._driver = None

    # --- the serving version, the same on every proxy -----------------------------------------

    async def _announce_serving(self, target: VersionRef) -> None:
        """Every other proxy on the database takes `target` as the serving version: the base of its
        next gates and swaps, what a failed swap restores, a new version's parent."""
        if self.bus is None:
            return
        try:
            await self.bus.notify({"op": "serving", "version": {"id": target.id, "name": target.name,
                                                                "checkpoint": target.checkpoint}})
        except Exception as e:  # they read the serving row when their listener reconnects
            log.warning("serving version not announced (%s: %s)", type(e).__name__, e)

    async def on_serving(self, msg: dict[str, Any]) -> None:
        """Another proxy made a version the serving one (the swap channel's `serving` note)."""
        v = msg.get("version")
        if isinstance(v, dict) and all(isinstance(v.get(k), str) for k in ("id", "name", "checkpoint")):
            self.current = VersionRef(v["id"], v["name"], v["checkpoint"])
            log.info("%s serves now (swapped by another proxy)", v["name"])

    async def read_serving(self) -> None:
        """The serving version as PostgreSQL records it: when the listener (re)connects, since it may
        have missed a `serving` note. Not while this proxy swaps (its own view is the newer one)."""
        factory = self.state.factory
        if factory is None or self.current is None or self._driver is not None or self.lock.locked():
            return  # before start-up's own read (it also registers the base), or mid-swap

        def read() -> VersionRef | None:
            with factory() as s:
                row = serving_version(s)
                return VersionRef(row.id, row.name, row.checkpoint) if row else None

        found = await asyncio.to_thread(read)
        if found is not None and found != self.current:
            log.info("%s serves now (read on reconnecting)", found.name)
            self.current = found

    @contextlib.asynccontextmanager
    async def closed(self, replica: Replica) -> AsyncIterator[Replica]:
        """`replica`'s gate closed and drained on this proxy and, while driving, on every proxy; on
        leaving, every proxy reopens it stamping `replica.version` (what the body left there)."""
        async with self.state.pool.swapping(replica, self.drain_timeout_s):
            driver = self._driver
            if driver is None:
                yield replica
                return
            try:
                await driver.close(replica)
            except BaseException:
                with contextlib.suppress(Exception):
                    await driver.open(replica)
                raise
            try:
                yield replica
            finally:
                await driver.open(replica)

    @contextlib.asynccontextmanager
    async def window(self, replica: Replica, target: str) -> AsyncIterator[Replica]:
        """A keep-mode swap window on `replica`, on this proxy and, while driving, on every proxy
        (each has opened it before the body runs); on leaving, every proxy stamps `replica.version`."""
        replica.begin_window(target)
        driver = self._driver
        try:
            if driver is not None:
                try:
                    await driver.close(replica, keep=target)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await driver.open(replica)
                    raise
            try:
                yield replica
            finally:
                if driver is not None:
                    await driver.open(replica)
        finally:
            replica.end_window()

    def start_gates(self, target: VersionRef, run: Callable[[], Coroutine[Any, Any, dict[str, Any] | None]]
                    ) -> asyncio.Task:
        """Start a candidate's gates once (a second POST of the same candidate joins the first run)."""
        task = self.gate_tasks.get(target.id)
        if task is None:
            task = asyncio.get_running_loop().create_task(run(), name=f"gates:{target.name}")
            self.gate_tasks[target.id] = task
            task.add_done_callback(lambda _: self.gate_tasks.pop(target.id, None))
        return task

    # --- start-up -------------------------------------------------------------------------------

    @property
    def engine(self) -> EngineClient:
        engine = self.state.engine_client
        assert engine is not None, "the app is not started"
        return engine

    async def start_up(self) -> None:
        """Read the serving version (registering `base` the first time), stamp replicas with it and
        tell each vLLM its name. A task on the event loop (its database reads on threads); retries
        until the upstream answers."""
        while True:
            try:
                await self._start_up_once()
                self.ready.set()
                return
            except Exception as e:  # the upstream may still be starting
                log.warning("versions start-up: %s: %s; retrying", type(e).__name__, redact_url_text(str(e)))
                await asyncio.sleep(2.0)

    async def _start_up_once(self) -> None:
        state = self.state
        factory = state.factory
        assert factory is not None, "the database is not connected"

        def read() -> tuple[VersionRef | None, CanaryRef | None]:
            with factory() as s, s.begin():
                row = serving_version(s)
                return VersionRef(row.id, row.name, row.checkpoint) if row else None, active_canary(s)

        ref, canary = await asyncio.to_thread(read)
        found = await asyncio.gather(*(_root(self.engine, r.url) for r in state.pool.replicas))
        roots = {r.url: root for r, root in zip(state.pool.replicas, found, strict=True)}
        if ref is None:
            root = next((x for x in roots.values() if x), None)
            if root is None:
                raise SwapError("no replica answered GET /v1/models: cannot name the base checkpoint")
            ref = await asyncio.to_thread(self._register_base, root)
        # A canary that was running when the proxy stopped goes on: its group still holds the
        # candidate's weights (gate 3, proxy.rollout.canary resumes its monitor).
        in_canary = set(canary.replicas) if canary else set()
        for replica in state.pool.replicas:
            replica.version = canary.candidate if replica.label in in_canary else ref.name
        self.current = ref
        self.canary_at_start = canary
        if canary is not None:
            state.canary.activate(canary, [r.label for r in state.pool.replicas])
            log.info("canary of %s resumed on %s", canary.candidate, ", ".join(canary.replicas))
        for replica in state.pool.replicas:
            try:
                reported = await self.engine.weight_version(replica.url, timeout=5.0)
                fresh_base = reported == "default" and roots.get(replica.url) == ref.checkpoint
                if reported != replica.version and not fresh_base and replica.label not in in_canary \
                        and await asyncio.to_thread(self._left_by_gates, reported):
                    # A proxy stopped while a candidate's weights were loaded for its gates: the
                    # serving weights go back before any call is stamped with the serving version.
                    log.warning("replica %s still holds candidate %r (a gate was interrupted): loading %s again",
                                replica.label, reported, ref.name)
                    await load_weights(self.engine, replica, ref.checkpoint, ref.name, timeout_s=self.load_timeout_s)
                elif reported != replica.version and not fresh_base:
                    log.warning("replica %s reports weight version %r but it serves %r; its tokens are stamped %r",
                                replica.label, reported, replica.version, replica.version)
                tagged = await self.engine.tag_version(replica.url, replica.version, timeout=5.0)
                if not 200 <= tagged.status < 300:
                    raise SwapError(f"/update_weight_version answered {tagged.status}")
            except Exception as e:
                log.warning("could not sync the weight version of %s: %s: %s", replica.label, type(e).__name__,
                            redact_url_text(str(e)))
        log.info("serving version %s (%s) on %d replica(s)", ref.name, ref.checkpoint, len(state.pool.replicas))
        if not state.settings.tokenizer:  # unset (or empty in compose): find it (files: on a thread)
            await asyncio.to_thread(self._find_tokenizer, [*roots.values(), ref.checkpoint])

    def _left_by_gates(self, reported: str | None) -> bool:
        """Whether a replica's weight version names a version that never served (a candidate, or one
        its gates rejected): weights a gate loaded and could not put back."""
        if not reported:
            return False
        with self.state.factory() as s:
            status = s.scalar(select(t.ModelVersion.status).where(t.ModelVersion.name == reported))
        return status in (VersionStatus.candidate, VersionStatus.evaluating, VersionStatus.rejected, VersionStatus.failed)

    def _find_tokenizer(self, roots: list[str | None]) -> None:
        """Trainable by default: with the served model's tokenizer the writer keeps cleaned token ids of
        steps that touched redacted text instead of dropping them (proxy/governance/tokens.py)."""
        for root in roots:
            spec = find_tokenizer(root) if root else None
            if spec:
                self.state.recorder.use_tokenizer(spec)
                log.info("token ids of redacted steps are cleaned with the served model's tokenizer %s", spec)
                return
        log.warning("the served model's tokenizer is not on this host (%s): token ids of steps that touched "
                    "redacted text are dropped; set ATDP_TOKENIZER to its folder to keep them", roots[0])

    def _register_base(self, root: str) -> VersionRef:
        state = self.state
        for _ in range(3):
            try:
                with state.factory() as s, s.begin():
                    row = serving_version(s)
                    if row is None:
                        row = s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == BASE_NAME)).first()
                        now = datetime.now(UTC)
                        if row is None:
                            row = t.ModelVersion(id=new_id(), name=BASE_NAME, checkpoint=root, status=VersionStatus.serving,
                                                 served_at=now, created_at=now, metrics={})
                            s.add(row)
                        else:
                            row.status, row.served_at = VersionStatus.serving, now
                        s.add(t.AuditEvent(actor="system", action="version.base", target=row.id,
                                           details={"checkpoint": row.checkpoint}))
                    return VersionRef(row.id, row.name, row.checkpoint)
            except IntegrityError:  # another proxy registered it at the same moment
                continue
        raise SwapError("could not register the base version")

    # --- swaps ----------------------------------------------------------------------------------

    async def swap(self, target: VersionRef, replicas: list[Replica] | None = None, *,
                   previous: VersionRef | None = None, becomes_current: bool = True) -> dict[str, Any]:
        """Swap every replica (or `replicas`, a canary's group) to `target`, one at a time; on any
        failure restore `previous` (default: the serving version) on each replica touched. Returns
        {"ok", "error", "seconds", "replicas": [...]}; the caller records statuses. `becomes_current`:
        `target` is then the serving version (not for a canary's group)."""
        assert self.state.engine_client is not None, "the app is not started"
        previous = previous or self.current
        if previous is None:
            raise ApiError(503, "the serving version is not known yet; try again shortly")
        async with self.driving():  # SwapBusy (409) when another proxy swaps: nothing was touched
            return await self._swap(target, replicas, previous, becomes_current)

    async def _swap(self, target: VersionRef, replicas: list[Replica] | None, previous: VersionRef,
                    becomes_current: bool) -> dict[str, Any]:
        pool = self.state.pool
        t0 = time.perf_counter()
        done: list[Replica] = []
        timings: list[dict[str, Any]] = []
        try:
            for replica in pool.replicas if replicas is None else replicas:
                timings.append(await self._swap_one(replica, target, previous))
                done.append(replica)
        except Exception as e:
            error = f"{type(e).__name__}: {redact_url_text(str(e))}" if str(e) else f"{type(e).__name__} (drain timeout?)"
            for replica in done:
                await self._roll_back(replica, previous)
            telemetry.SWAPS.labels("failed").inc()
            log.error("swap to %s failed (%s); %s serves on every replica", target.name, error, previous.name)
            return {"ok": False, "error": error, "seconds": time.perf_counter() - t0, "replicas": timings}
        seconds = time.perf_counter() - t0
        if becomes_current:
            self.current = target
            await self._announce_serving(target)
        telemetry.SWAPS.labels("ok").inc()
        telemetry.SWAP_SECONDS.observe(seconds)
        log.info("%s %s on %d replica(s) (%.3f s)", "now serving" if becomes_current else "loaded", target.name,
                 len(done), seconds)
        return {"ok": True, "error": None, "seconds": seconds, "replicas": timings}

    async def _swap_one(self, replica: Replica, target: VersionRef, previous: VersionRef) -> dict[str, Any]:
        engine = self.engine
        t_gate = time.perf_counter()
        source = source_for(target.checkpoint, target.name, self.transfer)
        if self.mode == "keep":
            async with self.window(replica, target.name):
                t_load = time.perf_counter()
                # A failed update puts the previous weights back (from disk) before the engine resumes.
                timings = await update(engine, replica, source, timeout_s=self.load_timeout_s, mode="keep",
                                       fallback=from_checkpoint(previous.checkpoint, previous.name))
                replica.version = target.name
        else:
            async with self.closed(replica):
                t_load = time.perf_counter()
                try:
                    timings = await update(engine, replica, source, timeout_s=self.load_timeout_s)
                except BaseException:
                    # The reload may have half-replaced the weights: put the old ones back before
                    # the gate reopens.
                    await self.restore(replica, previous)
                    raise
                replica.version = target.name
        return {"url": replica.label, "mode": self.mode, "drain_s": round(t_load - t_gate, 4),
                "load_s": round(time.perf_counter() - t_load, 4), "window_s": timings.window_s,
                "routes_s": timings.steps}

    async def _roll_back(self, replica: Replica, previous: VersionRef) -> None:
        if self.mode == "keep":
            async with self.window(replica, previous.name):
                await self.restore(replica, previous, mode="keep")
        else:
            async with self.closed(replica):
                await self.restore(replica, previous)

    async def restore(self, replica: Replica, previous: VersionRef, *, mode: SwapMode = "drain") -> None:
        try:
            await load_weights(self.engine, replica, previous.checkpoint, previous.name,
                               timeout_s=self.load_timeout_s, mode=mode)
            replica.version = previous.name
        except Exception as e:
            # The replica's weights are unknown now: keep calls away from it for a while.
            log.error("could not restore %s on %s: %s: %s", previous.name, replica.label, type(e).__name__,
                      redact_url_text(str(e)))
            replica.mark_dead(30.0)

    async def wait_ready(self) -> None:
        if not self.ready.is_set() and not await asyncio.to_thread(self.ready.wait, 30.0):
            raise ApiError(503, "model versions are not loaded yet (database or upstream starting)")


async def _root(engine: EngineClient, url: str) -> str | None:
    """The checkpoint a replica was started with: `root` of its first model in GET /v1/models."""
    try:
        data = (await engine.models(url, timeout=5.0)).json().get("data") or []
    except Exception:
        return None
    return (data[0].get("root") or data[0].get("id")) if data else None
