"""The one-request weight update: the extension vLLM's API server loads
(`proxy/rollout/vllm_ext/atdp_update.py`, driven here through Starlette with a recording engine
client in place of vLLM's), and the proxy's use of it (`proxy.rollout.engine_weights.update`, against
a scripted engine). The real engine serves it in tests/integration/test_swap_keep_vllm.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette

from proxy.rollout.engine_weights import SwapError, from_checkpoint, from_transfer, update
from proxy.rollout.vllm_ext import atdp_update
from proxy.upstream import ReplicaPool
from tests.engine_standin import serving


class EngineClient:
    """vLLM's `EngineClient` calls the extension makes, recorded; `fail` names a checkpoint whose
    reload raises, `reset` is what `reset_prefix_cache` answers."""

    def __init__(self, fail: str | None = None, reset: bool = True) -> None:
        self.calls: list[str] = []
        self.fail, self.reset = fail, reset

    async def sleep(self, level: int, mode: str) -> None:
        assert level == 0
        self.calls.append(f"pause:{mode}")

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        assert reset_running_requests and reset_external
        self.calls.append("reset")
        return self.reset

    async def collective_rpc(self, method: str, kwargs: dict[str, str]) -> list[None]:
        assert method == "reload_weights"
        await asyncio.sleep(0.01)  # the reload takes a while; the tag is sent beside it
        path = kwargs["weights_path"]
        self.calls.append(f"reload:{path}")
        if path == self.fail:
            raise RuntimeError(f"no checkpoint at {path}")
        return [None]

    async def update_weight_version(self, name: str) -> None:
        self.calls.append(f"tag:{name}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


def _app(engine: EngineClient) -> Starlette:
    app = Starlette()
    app.state.engine_client = engine
    app.add_middleware(atdp_update.AtdpUpdate)
    return app


def _post(app: Starlette, body: object, *, method: str = "POST") -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vllm") as c:
            return await c.request(method, atdp_update.PATH, content=json.dumps(body))

    return asyncio.run(go())


@pytest.fixture(autouse=True)
def dev_mode(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")


def test_the_extension_pauses_reloads_resets_tags_and_resumes_in_one_request():
    engine = EngineClient()
    r = _post(_app(engine), {"mode": "keep", "checkpoint": "/ckpt/v1", "name": "v1", "fallback": None})
    assert r.status_code == 200, r.text
    assert engine.calls == ["pause:keep", "reset", "tag:v1", "reload:/ckpt/v1", "resume"]
    data = r.json()
    assert set(data["steps"]) == {"sleep", "reset", "reload", "tag", "resume"} and data["window_s"] >= 0.01


def test_a_failed_reload_puts_the_fallback_back_before_resuming_and_answers_500():
    engine = EngineClient(fail="/ckpt/bad")
    r = _post(_app(engine), {"mode": "keep", "checkpoint": "/ckpt/bad", "name": "v2",
                             "fallback": {"checkpoint": "/ckpt/v1", "name": "v1"}})
    assert r.status_code == 500 and "reload failed: RuntimeError: no checkpoint at /ckpt/bad" in r.json()["error"]
    assert engine.calls == ["pause:keep", "reset", "tag:v2", "reload:/ckpt/bad", "tag:v1", "reload:/ckpt/v1",
                            "resume"]
    # drain mode (`wait`): no fallback here (the proxy restores behind its closed gate), resumed all the same
    engine = EngineClient(fail="/ckpt/bad")
    r = _post(_app(engine), {"mode": "wait", "checkpoint": "/ckpt/bad", "name": "v2",
                             "fallback": {"checkpoint": "/ckpt/v1", "name": "v1"}})
    assert r.status_code == 500 and engine.calls == ["pause:wait", "reset", "tag:v2", "reload:/ckpt/bad", "resume"]


def test_a_prefix_cache_that_would_not_reset_fails_the_update():
    engine = EngineClient(reset=False)
    r = _post(_app(engine), {"mode": "keep", "checkpoint": "/ckpt/v2", "name": "v2",
                             "fallback": {"checkpoint": "/ckpt/v1", "name": "v1"}})
    assert r.status_code == 500 and "reset_prefix_cache answered False" in r.json()["error"]
    assert engine.calls[-3:] == ["tag:v1", "reload:/ckpt/v1", "resume"]


@pytest.mark.parametrize("body", [{"mode": "abort", "checkpoint": "/c", "name": "v"}, {"mode": "keep", "name": "v"},
                                  {"mode": "keep", "checkpoint": "/c", "name": "v", "fallback": {"name": "v0"}},
                                  ["not", "an", "object"], "{broken"])
def test_a_bad_body_is_a_400_and_touches_nothing(body):
    engine = EngineClient()
    app = _app(engine)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vllm") as c:
            return await c.post(atdp_update.PATH, content=body if isinstance(body, str) else json.dumps(body))

    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"] and engine.calls == []


def test_only_post_and_only_in_dev_mode(monkeypatch):
    engine = EngineClient()
    assert _post(_app(engine), {}, method="GET").status_code == 405
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    r = _post(_app(engine), {"mode": "keep", "checkpoint": "/c", "name": "v"})
    assert r.status_code == 404 and engine.calls == []  # vLLM's own app answers: no such route


# -- the proxy's side ----------------------------------------------------------------------------


class Engine:
    """A vLLM with (`serves=True`) or without the extension, as the proxy's HTTP client sees it."""

    def __init__(self, serves: bool, status: int = 200) -> None:
        self.serves, self.status = serves, status
        self.paths: list[str] = []
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path == atdp_update.PATH:
            if not self.serves:
                return httpx.Response(404, json={"detail": "Not Found"})
            self.bodies.append(json.loads(request.content))
            if self.status != 200:
                return httpx.Response(self.status, json={"error": "reload failed: RuntimeError: no checkpoint"})
            return httpx.Response(200, json={"steps": {"sleep": 0.002, "reload": 0.013}, "window_s": 0.018})
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={})


def _update(engine: Engine, source, pool: ReplicaPool | None = None, **kw):
    pool = pool or ReplicaPool(["http://e:1"])
    replica = pool.replicas[0]

    async def go():
        async with serving(engine) as (base, client):
            replica.url = base  # the replica (and what it learnt of the engine) answers at the stand-in's address
            return await update(client, replica, source, timeout_s=5, **kw)

    return asyncio.run(go())


def test_the_proxy_updates_in_one_request_when_the_engine_serves_it():
    engine = Engine(serves=True)
    t = _update(engine, from_checkpoint("/ckpt/v1", "v1"), mode="keep", fallback=from_checkpoint("/ckpt/v0", "v0"))
    assert engine.paths == [atdp_update.PATH]
    assert engine.bodies == [{"mode": "keep", "checkpoint": "/ckpt/v1", "name": "v1",
                              "fallback": {"checkpoint": "/ckpt/v0", "name": "v0"}}]
    assert t.steps["engine:window"] == 0.018 and t.steps["engine:reload"] == 0.013
    assert t.window_s == t.steps["atdp/update_weights"] >= 0  # the proxy's view: sent to answered
    # drain mode sends no fallback: the caller restores behind its closed gate
    engine = Engine(serves=True)
    _update(engine, from_checkpoint("/ckpt/v1", "v1"), fallback=from_checkpoint("/ckpt/v0", "v0"))
    assert engine.bodies[0]["mode"] == "wait" and engine.bodies[0]["fallback"] is None


def test_an_engine_without_it_is_asked_once_then_updated_route_by_route():
    engine, pool = Engine(serves=False), ReplicaPool(["http://e:1"])
    _update(engine, from_checkpoint("/ckpt/v1", "v1"), pool, mode="keep")
    _update(engine, from_checkpoint("/ckpt/v2", "v2"), pool, mode="keep")
    assert engine.paths.count(atdp_update.PATH) == 1 and pool.replicas[0].update_route is False
    assert engine.paths[1:6] == ["/sleep", "/reset_prefix_cache", "/collective_rpc", "/update_weight_version",
                                 "/resume"]


def test_a_failed_update_in_one_request_is_a_swap_error_naming_the_checkpoint():
    with pytest.raises(SwapError, match=r"update_weights\(/ckpt/v1\) answered 500: reload failed"):
        _update(Engine(serves=True, status=500), from_checkpoint("/ckpt/v1", "v1"), mode="keep")


def test_an_nccl_transfer_never_takes_it():
    engine = Engine(serves=True)
    info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    _update(engine, from_transfer(info, "v3"), mode="keep")
    assert atdp_update.PATH not in engine.paths and "/finish_weight_update" in engine.paths
