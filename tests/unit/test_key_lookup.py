"""API-key lookups: the calls that arrive while one is under way share it (a busy client with a
placeholder key in open mode would otherwise send one database query per call each time the key's
miss expires)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from proxy.auth import Principal
from proxy.config import Settings
from proxy.state import AppState


def _request(key: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": [(b"authorization", f"Bearer {key}".encode())]})


def _state(tmp_path, open_mode: bool) -> AppState:
    settings = Settings(home=tmp_path, secret=b"s", open_mode=open_mode)
    return AppState(settings=settings, policies=None, pool=None, index=None, recorder=None,  # type: ignore[arg-type]
                    redactor=None, tracer=None)  # type: ignore[arg-type]


def test_concurrent_calls_with_one_unknown_key_share_one_lookup(tmp_path):
    state = _state(tmp_path, open_mode=True)
    queries: list[str] = []

    async def lookup(h: str) -> Principal | None:
        queries.append(h)
        await asyncio.sleep(0.05)  # the database answering
        state.misses[h] = 1e18  # as `_lookup` records a miss
        return None

    state._lookup = lookup  # type: ignore[method-assign]

    async def go() -> list[Principal]:
        return await asyncio.gather(*(state.authenticate(_request("placeholder")) for _ in range(32)))

    got = asyncio.run(go())
    assert len(queries) == 1 and not state.lookups  # one query; nothing left pending
    assert {p.tenant for p in got} == {state.settings.default_tenant} and all(p.key_id is None for p in got)


def test_a_known_key_found_by_one_lookup_serves_every_waiting_call(tmp_path):
    state = _state(tmp_path, open_mode=False)
    calls = 0

    async def lookup(h: str) -> Principal | None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        state.keys[h] = Principal(tenant="acme", key_id="k1")
        return state.keys[h]

    state._lookup = lookup  # type: ignore[method-assign]

    async def go() -> list[Principal]:
        first = await asyncio.gather(*(state.authenticate(_request("real-key")) for _ in range(8)))
        return [*first, await state.authenticate(_request("real-key"))]  # then from memory

    got = asyncio.run(go())
    assert calls == 1 and {(p.tenant, p.key_id) for p in got} == {("acme", "k1")}
