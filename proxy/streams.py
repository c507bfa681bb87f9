"""Answering a call as a stream: the SSE response every door streams through, and the relay of vLLM's
chunks through a translator (messages, responses).

`GuardedStream` records the call and frees its replica however the stream ends (finished, failed
upstream, or the client leaving, even before the body starts); `Last` marks a body's final bytes,
sent together with the end of the response.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import orjson
from starlette.responses import StreamingResponse

from atdp_schema.models import StepStatus
from proxy.call import Answer, Call, close_upstream, finish, settle
from proxy.engine import UpstreamError
from proxy.translate.chunks import Chunk, read_chunk
from proxy.translate.sse import iter_sse_batches


class Translator(Protocol):
    def feed_part(self, part: Chunk) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...


async def relay(call: Call, resp: Answer, translator: Translator, fail: Callable[[str], list[bytes]],
                done: Callable[[str, dict[str, Any] | None], None]) -> AsyncIterator[bytes]:
    """vLLM's chat chunks -> capture (raw) and translator (client events); `done(status, error)` once.

    `done` runs however the stream ends: completed ("ok"), upstream error ("error"), or the client
    leaving mid-stream ("aborted", the generator is closed at its pending `yield`).
    """
    status, error = StepStatus.aborted, {"type": "client_disconnected", "message": "the client went away mid-stream"}
    try:
        batches = iter_sse_batches(resp.aiter_raw())
        complete = failed = False
        async for batch in batches:
            # One write per network read: a fast engine's chunks that arrived together leave together.
            out: list[bytes] = []
            for payload in batch:
                if payload == b"[DONE]":  # the engine's answer is complete: end the client's stream now
                    complete = True
                    break
                part = read_chunk(orjson.loads(payload))  # read once: capture and translator share it
                if part.error is not None:  # vLLM's mid-stream failure
                    status, error = StepStatus.error, {"type": "upstream_error", "message": part.error}
                    out += translator.feed_part(part)  # the translator answers with its error event
                    failed = True
                    break
                call.capture.feed(part)
                if call.ttft_s is None and call.capture.has_output:
                    call.mark_token()
                out += translator.feed_part(part)
            if complete or failed:
                break
            if out:
                yield b"".join(out)
        else:
            complete, out = True, []  # an engine that ended without its [DONE]
        if failed:
            yield b"".join(out)
        elif complete:
            status, error = "ok", None
            last = b"".join(out) + b"".join(translator.finish())  # completes the translator's output first
            done(status, error)  # records the call and publishes its keys ...
            await settle(call)  # ... which are in the database before the client's last event
            yield Last(last)
            await close_engine_part(call, batches)
    except UpstreamError as e:
        status, error = "error", {"type": "upstream_error", "message": e.message}
        yield b"".join(fail(e.message))
    finally:
        try:
            if not call.finished:
                done(status, error)
        finally:
            await close_upstream(call, resp)


# How long the engine may take, after its `[DONE]`, to end its response (the chunked body's last bytes,
# normally right behind it). Read in that time, the connection goes back to the pool for the next
# call; otherwise it is closed.
END_WAIT_S = 2.0


async def close_engine_part(call: Call, rest: AsyncIterator[Any]) -> None:
    """After the engine's `[DONE]` (the client has its whole answer): free the replica's slot, since
    the engine's work is done, then read the rest of its response, bounded, so the connection is kept."""
    await close_upstream(call, None)
    with contextlib.suppress(TimeoutError, UpstreamError):
        async with asyncio.timeout(END_WAIT_S):
            async for _ in rest:
                pass


class Last(bytes):
    """A stream body's final bytes: `GuardedStream` sends them together with the end of the response
    (one write to the client instead of two)."""


class GuardedStream(StreamingResponse):
    """An SSE response that records its call and frees its replica however the stream ends.

    Streamed by plain asyncio rather than starlette's `StreamingResponse.__call__`: uvicorn reports
    ASGI spec 2.3, for which starlette runs every stream in an anyio task group, a large part of a
    streamed call's framework cost (docs/scale.md). A watcher task waits for the client's disconnect
    and cancels the streaming task, so a client that leaves while the engine is silent still stops
    the upstream at once. If the client leaves before the body iterator even starts, the generator's
    own `finally` never runs; the one here still records the step (aborted) and releases the upstream.
    """

    def __init__(self, call: Call, resp: Answer, body: AsyncIterator[bytes], headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={**call.response_headers(), "cache-control": "no-cache", **(headers or {})})
        self._call, self._resp = call, resp

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        assert task is not None
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            task.cancel()  # delivered at the stream's pending await: the upstream read, usually

        # The watcher only runs while this task is suspended, and is cancelled before this task awaits
        # anything once the response is complete (uvicorn's receive then says "disconnect" too).
        watcher = asyncio.get_running_loop().create_task(watch())
        body = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ended = False
            async for chunk in body:
                ended = isinstance(chunk, Last)
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                if ended:  # the response is complete: what the generator does after it (freeing the
                    watcher.cancel()  # upstream) is not a client leaving, and is not cancelled
                elif left:  # gone, and the cancel was lost (3.11's wait_for can swallow one): stop here
                    if task.cancelling():
                        task.uncancel()  # the request it counts is answered here
                    break
            if not ended and not left:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()  # the client left: the stream ends here, and its step says so (below)
        finally:
            watcher.cancel()
            try:
                aclose = getattr(body, "aclose", None)
                if aclose is not None:  # a generator cancelled at a `yield` runs its own `finally` now
                    await aclose()
            finally:
                if not self._call.finished:
                    finish(self._call, status=StepStatus.aborted,
                           error={"type": "client_disconnected", "message": "the client went away before the stream"},
                           native_output=self._call.capture.assistant_message())
                await close_upstream(self._call, self._resp)
