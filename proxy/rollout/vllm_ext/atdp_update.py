"""A weight update in one request, served inside vLLM's API server (pure ASGI middleware).

Loaded with `--middleware atdp_update.AtdpUpdate` and this folder on the server's PYTHONPATH
(`proxy.demo.vllm.VLLMServer` does both). It imports nothing from atdp: it runs in vLLM's own
environment. `POST /atdp/update_weights` does what `proxy.rollout.engine_weights.update` does with
five dev-mode routes (pause with `/sleep?level=0`, prefix reset, reload, version tag, `/resume`)
with the same engine calls in one request, so the engine is paused for one HTTP round trip instead
of three: on a 2-core EPYC each route costs about 2-2.5 ms, around a 13 ms reload of the tiny model.

Body: {"mode": "keep" | "wait", "checkpoint": DIR, "name": VERSION, "fallback": {"checkpoint": DIR,
"name": VERSION} | null}. Answers 200 {"steps": {...}, "window_s": s} once the engine has resumed,
or 500 {"error": ...} when the update failed (keep mode with a fallback: the previous weights and
their tag are back before the engine resumes). Served only with VLLM_SERVER_DEV_MODE=1, as the
routes it stands for; like them, it is outside vLLM's API-key prefixes (/v1, ...), so the same
network rules apply (the proxy reaches vLLM on a private address).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable
from typing import Any

PATH = "/atdp/update_weights"
MODES = ("keep", "wait")


class UpdateError(Exception):
    pass


async def _timed(steps: dict[str, float], name: str, call: Awaitable[Any]) -> Any:
    t0 = time.perf_counter()
    try:
        return await call
    except Exception as e:  # the answer names the engine call that failed
        raise UpdateError(f"{name} failed: {type(e).__name__}: {e}") from e
    finally:
        steps[name] = round(time.perf_counter() - t0, 4)


async def _all(*calls: Awaitable[Any]) -> list[Any]:
    """Await every call (none may still run when the caller reloads again or resumes), then raise the first failure."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)


async def _load(engine: Any, steps: dict[str, float], checkpoint: str, name: str, *, reset: bool) -> None:
    """Reload `checkpoint`, tag it `name` and (with `reset`) drop the prefix cache: all while paused, so
    sent together; the engine core runs them one after another between no two steps."""
    calls = [_timed(steps, "reload", engine.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})),
             _timed(steps, "tag", engine.update_weight_version(name))]
    if reset:
        calls.insert(0, _timed(steps, "reset", engine.reset_prefix_cache(True, True)))
    results = await _all(*calls)
    if reset and results[0] is not True:
        raise UpdateError(f"reset failed: reset_prefix_cache answered {results[0]!r}")


async def update(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    mode, checkpoint, name, fallback = body.get("mode"), body.get("checkpoint"), body.get("name"), body.get("fallback")
    if mode not in MODES or not isinstance(checkpoint, str) or not isinstance(name, str):
        raise ValueError("mode ('keep' or 'wait'), checkpoint and name are required")
    if fallback is not None and not (isinstance(fallback, dict) and isinstance(fallback.get("checkpoint"), str)
                                     and isinstance(fallback.get("name"), str)):
        raise ValueError("fallback must be {checkpoint, name}")
    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    await _timed(steps, "sleep", engine.sleep(0, mode))
    try:
        try:
            await _load(engine, steps, checkpoint, name, reset=True)
        except BaseException:
            if fallback is not None and mode == "keep":
                await _load(engine, {}, fallback["checkpoint"], fallback["name"], reset=False)
            raise
    finally:
        # Never leave the engine paused: it would hold every request sent to it.
        await _timed(steps, "resume", engine.resume_generation())
    return {"steps": steps, "window_s": round(time.perf_counter() - t0, 4)}


class AtdpUpdate:
    """Answers `POST /atdp/update_weights`; everything else goes to vLLM's app untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _answer(send, 405, {"error": "POST only"})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            result = await update(scope["app"].state.engine_client, body)
        except ValueError as e:  # json.JSONDecodeError is one
            await _answer(send, 400, {"error": str(e)})
        except Exception as e:  # the update failed; the engine was resumed (and restored, with a fallback)
            await _answer(send, 500, {"error": str(e) if isinstance(e, UpdateError) else f"{type(e).__name__}: {e}"})
        else:
            await _answer(send, 200, result)


async def _answer(send: Any, status: int, content: dict[str, Any]) -> None:
    data = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
