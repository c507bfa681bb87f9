"""One replica's weight update through vLLM's dev-mode routes, in either swap mode.

drain: the proxy's gate already kept calls away and waited for those in flight; the engine is asked
to pause once it has nothing running (`mode=wait`). keep: the engine freezes its running requests
where they are (`mode=keep`) and carries them on after `/resume`, so the time between pausing and
`/resume` (the window) is what a request in flight waits. In keep mode a failed update puts the
previous weights back before resuming: no token is ever sampled by half-replaced weights.

The pause is `/sleep?level=0` (the engine's scheduler pause, answered as soon as it holds) rather
than `/pause`, whose route sleeps 20 ms after the engine has paused (vLLM's
`AsyncLLM.pause_generation`, "not required for correctness") and would double a small model's
window. `/pause` would also reset the prefix cache, preempting running requests so they resume
on the new weights' keys and values; with `/sleep` that reset is its own call
(`/reset_prefix_cache?reset_running_requests=true`), sent beside the reload: both happen while the
engine is paused, so their order does not matter. So is the version tag (`/update_weight_version`):
vLLM's engine core stamps outputs with the version current when the step that sampled them ends,
and no step runs while paused.

The weights come from a checkpoint folder (`reload_weights`, disk) or from the trainer over vLLM's
weight transfer engine (nccl: `/start_weight_update`, `/update_weights` while the trainer
broadcasts, `/finish_weight_update` with the version); see `trainer/weight_transfer.py` for the
sending side. The nccl path is taken only with `ATDP_WEIGHT_TRANSFER=nccl` and a checkpoint whose
trainer left `weight_transfer.json` in it (it broadcasts that version); anything else (a folder
posted by hand, a file that cannot be read, gates, rollbacks) reloads from disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from proxy.engine import EngineClient, Reply
from proxy.upstream import Replica

log = logging.getLogger("atdp.versions")

SwapMode = Literal["drain", "keep"]
TRANSFER_FILE = "weight_transfer.json"  # written by trainer.weight_transfer (same name)
PAUSE_MODE: dict[str, str] = {"drain": "wait", "keep": "keep"}


class SwapError(Exception):
    pass


@dataclass
class Timings:
    """Seconds each route took, and the window: from sending `/pause` to `/resume` answered."""

    steps: dict[str, float] = field(default_factory=dict)
    window_s: float = 0.0


async def _check(resp: Reply, what: str) -> None:
    if resp.status >= 400:
        raise SwapError(f"{what} answered {resp.status}: {resp.text[:300]}")


# A weight source: given the replica's client call (route, json), put `version`'s weights in place.
Source = Callable[["Routes"], Awaitable[None]]


@dataclass
class Routes:
    """The dev-mode routes of one replica, each call checked and timed."""

    engine: EngineClient
    replica: Replica
    timeout_s: float
    timings: Timings = field(default_factory=Timings)

    async def post(self, route: str, *, json: dict[str, Any] | None = None, params: dict[str, str] | None = None,
                   what: str | None = None) -> Reply:
        t0 = time.perf_counter()
        resp = await self.engine.control(self.replica.url, route, json=json, params=params, timeout=self.timeout_s)
        # errors name the replica without its credentials (and the route apart: a URL's path is cut)
        await _check(resp, f"{self.replica.label} {what or route}")
        self.timings.steps[route.strip("/")] = round(time.perf_counter() - t0, 4)
        return resp


@dataclass(frozen=True)
class Checkpoint:
    """The disk path: the engine reloads `checkpoint` (same architecture) and is tagged `name`."""

    checkpoint: str
    name: str

    async def __call__(self, routes: Routes) -> None:
        # Both while the engine is paused, so sent together (one round trip less in the window): the
        # engine core stamps a step's outputs with its version when that step ends, and no step
        # runs until `/resume`. A failed reload is followed by the previous weights and their tag
        # (the keep-mode fallback, or the drain-mode restore behind the closed gate).
        await _all(routes.post("/collective_rpc", json={"method": "reload_weights",
                                                        "kwargs": {"weights_path": self.checkpoint}},
                               what=f"reload_weights({self.checkpoint})"),
                   routes.post("/update_weight_version", json={"new_version": self.name}))


def from_checkpoint(checkpoint: str, name: str) -> Source:
    return Checkpoint(checkpoint, name)


def from_transfer(info: dict[str, list], name: str) -> Source:
    """The nccl path: the engine's workers receive `info`'s tensors from the trainer's broadcast."""

    async def load(routes: Routes) -> None:
        await routes.post("/start_weight_update")
        await routes.post("/update_weights", json={"update_info": info})
        await routes.post("/finish_weight_update", json={"weight_version": name})

    return load


def transfer_info(checkpoint: str) -> dict[str, list] | None:
    """The update info the trainer left in `checkpoint` for an NCCL transfer, or None (disk)."""
    try:
        data = json.loads((Path(checkpoint) / TRANSFER_FILE).read_text())
        info = data["update_info"]
        n = len(info["names"])
        if data.get("backend") != "nccl" or not n or len(info["dtype_names"]) != n or len(info["shapes"]) != n:
            raise ValueError("names, dtype_names and shapes must be non-empty and of one length")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s/%s unusable (%s): the engine reloads the checkpoint from disk", checkpoint, TRANSFER_FILE, e)
        return None
    return {"names": info["names"], "dtype_names": info["dtype_names"], "shapes": info["shapes"]}


def source_for(checkpoint: str, name: str, transfer: str) -> Source:
    """How the swap to `name` gets its weights: over NCCL when configured and the trainer sends them."""
    info = transfer_info(checkpoint) if transfer == "nccl" else None
    return from_transfer(info, name) if info is not None else from_checkpoint(checkpoint, name)


async def reset_caches(routes: Routes) -> None:
    """What `/pause` does besides pausing: drop the prefix cache and preempt the running requests, so
    no key or value computed by the old weights is read by the new ones."""
    resp = await routes.post("/reset_prefix_cache", params={"reset_running_requests": "true",
                                                            "reset_external": "true"})
    if resp.json().get("success") is not True:
        raise SwapError(f"{routes.replica.label} reset_prefix_cache answered {resp.text[:300]}")


async def _all(*steps: Awaitable[object]) -> None:
    """Run `steps` together and wait for every one (none may still be under way when the caller puts
    the old weights back or resumes); then raise the first failure."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


UPDATE_ROUTE = "/atdp/update_weights"  # proxy/rollout/vllm_ext/atdp_update.py, when vLLM loaded it


async def _update_in_one(routes: Routes, source: Checkpoint, mode: SwapMode, fallback: Checkpoint | None
                         ) -> Timings | None:
    """The same update through the engine's `/atdp/update_weights` (one request: the engine is paused
    for one round trip instead of three). None when the engine does not serve it (a vLLM started
    without the extension answers 404): the replica is then updated route by route from now on."""
    body = {"mode": PAUSE_MODE[mode], "checkpoint": source.checkpoint, "name": source.name,
            "fallback": {"checkpoint": fallback.checkpoint, "name": fallback.name} if fallback else None}
    t0 = time.perf_counter()
    resp = await routes.engine.control(routes.replica.url, UPDATE_ROUTE, json=body, timeout=routes.timeout_s)
    if resp.status in (404, 405):
        routes.replica.update_route = False
        log.info("%s does not serve %s: weight updates go route by route", routes.replica.label, UPDATE_ROUTE)
        return None
    routes.replica.update_route = True
    try:
        data = resp.json()
    except ValueError:
        data = {"error": resp.text[:300]}
    if resp.status >= 400:
        raise SwapError(f"{routes.replica.label} update_weights({source.checkpoint}) answered {resp.status}: "
                        f"{str(data.get('error', data))[:300]}")
    # The window as before, from the proxy's side (sent to answered: it holds the engine's pause,
    # which the engine reports as `engine:window`), so figures compare across both ways.
    seconds = round(time.perf_counter() - t0, 4)
    routes.timings.steps = {UPDATE_ROUTE.strip("/"): seconds, "engine:window": data.get("window_s"),
                            **{f"engine:{k}": v for k, v in data.get("steps", {}).items()}}
    routes.timings.window_s = seconds
    return routes.timings


async def update(engine: EngineClient, replica: Replica, source: Source, *, timeout_s: float,
                 mode: SwapMode = "drain", fallback: Source | None = None) -> Timings:
    """Pause, put `source`'s weights in place, resume. `fallback` (keep mode): the previous weights,
    loaded before resuming when `source` fails; the error is raised after. A checkpoint reload goes
    through the engine's one-request update when it serves one (`UPDATE_ROUTE`), else route by route."""
    routes = Routes(engine, replica, timeout_s)
    back = fallback if mode == "keep" else None
    if (isinstance(source, Checkpoint) and (back is None or isinstance(back, Checkpoint))
            and replica.update_route is not False):
        timings = await _update_in_one(routes, source, mode, back)
        if timings is not None:
            return timings
    t0 = time.perf_counter()
    await routes.post("/sleep", params={"level": "0", "mode": PAUSE_MODE[mode]}, what="pause (sleep level 0)")
    try:
        try:
            await _all(reset_caches(routes), source(routes))
        except BaseException:
            if fallback is not None and mode == "keep":
                await fallback(routes)
            raise
    finally:
        # Never leave a replica paused: it would hold every call sent to it.
        await routes.post("/resume")
        routes.timings.window_s = round(time.perf_counter() - t0, 4)
    return routes.timings


async def load_weights(engine: EngineClient, replica: Replica, checkpoint: str, name: str, *,
                       timeout_s: float, mode: SwapMode = "drain",
                       fallback: tuple[str, str] | None = None) -> Timings:
    """vLLM dev mode: pause, reload `checkpoint`, tag the version `name`, resume. `fallback`:
    (checkpoint, name) put back before resuming when the reload fails (keep mode)."""
    back = from_checkpoint(*fallback) if fallback else None
    return await update(engine, replica, from_checkpoint(checkpoint, name), timeout_s=timeout_s, mode=mode,
                        fallback=back)
