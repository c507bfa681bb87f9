"""What streaming one response costs the framework, per call, on an in-memory ASGI cycle.

uvicorn reports ASGI spec 2.3, for which starlette's `StreamingResponse` runs each stream in an anyio
task group (a task for the body, the caller waiting for the client's disconnect); from spec 2.4 on it
streams in the caller's task. `proxy.streams.GuardedStream` streams in the caller's task beside one
plain asyncio task that waits for the disconnect. The three, on the same 4-chunk body, no network:

  python bench/stream_response.py [--n 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Message


class Cycle:
    """uvicorn's receive/send, reduced: receive waits until the response is complete, then says the
    client is gone (what uvicorn's says then)."""

    def __init__(self) -> None:
        self.complete = asyncio.Event()

    async def receive(self) -> Message:
        await self.complete.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.complete.set()


async def body() -> AsyncIterator[bytes]:
    for _ in range(4):
        yield b"data: {}\n\n"


def starlette_stream(spec: str) -> Callable[[], Awaitable[None]]:
    scope = {"type": "http", "asgi": {"spec_version": spec}}

    async def one() -> None:
        c = Cycle()
        await StreamingResponse(body(), media_type="text/event-stream")(scope, c.receive, c.send)
    return one


async def watched() -> None:
    """GuardedStream's shape: the body in this task, a watcher task for the disconnect."""
    c = Cycle()
    task = asyncio.current_task()
    assert task is not None

    async def watch() -> None:
        while (await c.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await c.send({"type": "http.response.start", "status": 200, "headers": []})
        async for chunk in body():
            await c.send({"type": "http.response.body", "body": chunk, "more_body": True})
        await c.send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watcher.cancel()


async def timed(one: Callable[[], Awaitable[None]], n: int) -> float:
    for _ in range(n // 10):  # warm up
        await one()
    t0 = time.process_time()
    for _ in range(n):
        await one()
    return (time.process_time() - t0) / n * 1e6


async def main(n: int, rounds: int) -> None:
    cells = {"StreamingResponse, spec 2.3 (task group)": starlette_stream("2.3"),
             "StreamingResponse, spec 2.4 (no task group)": starlette_stream("2.4"),
             "GuardedStream's shape (watcher task)": watched}
    results: dict[str, list[float]] = {k: [] for k in cells}
    for _ in range(rounds):  # interleaved
        for name, one in cells.items():
            results[name].append(await timed(one, n))
    print(f"CPU us per streamed response, {rounds} interleaved rounds of {n}:")
    for name, us in results.items():
        print(f"  {name}: " + ", ".join(f"{u:.1f}" for u in us))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    try:
        import uvloop  # what `atdp serve` runs on (uvicorn[standard])
        uvloop.run(main(args.n, args.rounds))
    except ImportError:
        asyncio.run(main(args.n, args.rounds))
