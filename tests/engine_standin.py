"""A scripted engine for unit tests of the proxy's engine calls (`proxy.engine.EngineClient`).

The script is a function of an `httpx.Request` returning an `httpx.Response` (the shape the tests
were written in); it is served over HTTP on 127.0.0.1, so every call goes through the proxy's real
client, aiohttp included."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from proxy.engine import EngineClient

Script = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


@contextlib.asynccontextmanager
async def serving(script: Script, *, timeout_s: float = 5.0) -> AsyncIterator[tuple[str, EngineClient]]:
    """(the engine's base URL, an EngineClient) while `script` answers on it."""

    async def handle(request: web.BaseRequest) -> web.Response:
        body = await request.read()
        got = script(httpx.Request(request.method, str(request.url), headers=dict(request.headers), content=body))
        if inspect.isawaitable(got):  # a script that takes its time (without holding the event loop)
            got = await got
        headers = {k: v for k, v in got.headers.items() if k.lower() in ("content-type",)}
        return web.Response(status=got.status_code, body=got.content, headers=headers)

    server = RawTestServer(handle, host="127.0.0.1")
    await server.start_server()
    engine = EngineClient(timeout_s)
    try:
        yield str(server.make_url("")).rstrip("/"), engine
    finally:
        await engine.close()
        await server.close()
