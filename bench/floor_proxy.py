"""The stack's floor: the proxy's web stack with nothing of atdp's own work in it.

uvicorn (uvloop, httptools, no access log: as `atdp serve` runs it), one Starlette route, aiohttp
to the upstream (the proxy's own session settings), the answer passed back as it came: a body read
whole, or a stream relayed read by read. No authentication, parsing, sessions, capture, recording,
redaction or metrics. `bench/proxy_overhead.py --with-floor` measures it interleaved with the direct
call and the proxy, so the proxy's added latency splits into what the stack costs and what atdp adds.

  python bench/floor_proxy.py --port 8800 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.engine import make_session


class Forward:
    """The route's ASGI app: the request body to the upstream, its answer back as it comes (a stream
    read by read, without starlette's StreamingResponse task group; the proxy does without it too)."""

    def __init__(self, upstream: str) -> None:
        self.url = upstream + "/v1/chat/completions"
        self.http: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.http is not None
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        resp = await self.http.post(self.url, data=body, headers={"content-type": "application/json"})
        try:
            kind = resp.headers.get("content-type", "application/json")
            headers = [(b"content-type", kind.encode())]
            if not kind.startswith("text/event-stream"):  # whole, with its length (as the proxy answers)
                data = await resp.read()
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [*headers, (b"content-length", str(len(data)).encode())]})
                await send({"type": "http.response.body", "body": data})
                return
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            resp.release()


def build(upstream: str) -> Starlette:
    forward = Forward(upstream)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        forward.http = make_session(600.0)
        yield
        await forward.http.close()

    return Starlette(routes=[Route("/v1/chat/completions", forward, methods=["POST"])], lifespan=lifespan)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    uvicorn.run(build(args.upstream), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
