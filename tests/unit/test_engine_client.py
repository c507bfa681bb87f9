"""The engine client (`proxy.engine`): the auth header on every call, control calls that never follow a
redirect, a call's own timeout, and one exception for an engine that does not answer, without credentials."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from proxy.engine import EngineClient, EngineUnreachable
from tests.engine_standin import serving


def test_every_call_carries_the_auth_header_and_control_calls_follow_no_redirect():
    seen: list[tuple[str, str, str | None]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers.get("authorization")))
        if request.url.path == "/v1/models":
            return httpx.Response(307, headers={"location": "http://elsewhere:1/v1/models"})
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "v3"})
        return httpx.Response(200, json={"ok": True})

    async def go():
        async with serving(engine) as (base, _):
            client = EngineClient(5.0, {"authorization": "Bearer k"})
            try:
                listed = await client.models(base)
                version = await client.weight_version(base)
                tagged = await client.tag_version(base, "v4", timeout=2.0)
                chat = await client.post_json(base, "/v1/chat/completions/render", {"messages": []})
                resp = await client.open(base, "/v1/chat/completions", b"{}")
                body = await resp.aread()
                await resp.aclose()
            finally:
                await client.close()
        return listed, version, tagged, chat, body

    listed, version, tagged, chat, body = asyncio.run(go())
    assert listed.status == 307 and version == "v3" and tagged.status == 200 and chat.json() == {"ok": True}
    assert body == b'{"ok":true}'
    assert [s[:2] for s in seen] == [("GET", "/v1/models"), ("GET", "/weight_info"), ("POST", "/update_weight_version"),
                                     ("POST", "/v1/chat/completions/render"), ("POST", "/v1/chat/completions")]
    assert {s[2] for s in seen} == {"Bearer k"}


def test_an_engine_that_does_not_answer_is_one_exception_without_credentials():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://user:s3cret@127.0.0.1:{port}"

    async def go() -> list[EngineUnreachable]:
        client = EngineClient(5.0)
        errors = []
        try:
            for call in (client.models(base), client.control(base, "/resume", timeout=2.0),
                         client.open(base, "/v1/chat/completions", b"{}"), client.post_json(base, "/x", {})):
                with pytest.raises(EngineUnreachable) as e:
                    await call
                errors.append(e.value)
        finally:
            await client.close()
        return errors

    for e in asyncio.run(go()):
        assert e.status == 502 and e.kind == "ClientConnectorError" and "s3cret" not in e.message + e.detail


def test_a_call_s_own_timeout_bounds_its_read():
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1.5)
        return httpx.Response(200, json={})

    async def go() -> float:
        async with serving(slow) as (base, client):
            t0 = time.perf_counter()
            with pytest.raises(EngineUnreachable) as e:
                await client.control(base, "/sleep", timeout=0.3)
            assert "Timeout" in e.value.kind
            return time.perf_counter() - t0

    assert asyncio.run(go()) < 1.4
