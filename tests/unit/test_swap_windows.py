"""Keep-mode swap windows (proxy.upstream), the versions a step records from them, their
eligibility, and the order of one replica's dev-mode calls in each swap mode (a recording transport:
the failing reload in keep mode is the case a test cannot ask a healthy engine for)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from atdp_schema.models import Eligibility
from proxy.governance.policy import TenantPolicy, decide_eligibility
from proxy.rollout.engine_weights import SwapError, load_weights
from proxy.store.tokens import step_versions
from proxy.upstream import ReplicaPool
from tests.engine_standin import serving


def _lease(pool: ReplicaPool):
    return asyncio.run(pool.acquire(pool.replicas[0]))


def test_a_call_with_no_window_is_exact_and_one_spanning_a_window_names_both_versions():
    pool = ReplicaPool(["http://e:1"])
    r = pool.replicas[0]
    before = _lease(pool)
    assert before.window() is None
    r.begin_window("v1")
    during = _lease(pool)  # entered while the update was under way: its tokens may be v1's
    assert before.window() == ("base", "v1") and during.window() == ("base", "v1")
    r.version = "v1"
    r.end_window()
    after = _lease(pool)
    assert after.version == "v1" and after.window() is None
    assert before.window() == ("base", "v1")  # still known once the window closed


def test_a_window_announced_by_another_proxy_closes_with_the_version_it_names():
    pool = ReplicaPool(["http://e:1"])
    r = pool.replicas[0]
    lease = _lease(pool)
    r.begin_window("v2")
    r.end_window("v2")
    assert r.version == "v2" and not r.in_swap and lease.window() == ("base", "v2")


def test_step_versions_prefer_the_engine_then_the_window_then_the_served_version():
    assert step_versions(3, engine=["a", "a", "b"], window=("a", "b"), served="a") == ["a", "a", "b"]
    assert step_versions(2, engine=None, window=("a", "b"), served="a") == ["a|b", "a|b"]
    assert step_versions(2, engine=["a"], window=None, served="a") == ["a", "a"]  # a report that does not fit
    assert step_versions(1, engine=None, window=None, served=None) == ["unknown"]


def test_an_ambiguous_step_is_not_eligible_and_says_why():
    policy = TenantPolicy(training_consent=True)
    level, reason = decide_eligibility(policy, status="ok", redaction_counts={}, tokens_available=True,
                                       version_window=("base", "v1"))
    assert level == Eligibility.debug_only and reason == "version_ambiguous: base -> v1"
    assert decide_eligibility(policy, status="ok", redaction_counts={}, tokens_available=True) == (
        Eligibility.eligible, "ok")


class Engine:
    """Records the dev-mode calls; `fail` names a checkpoint whose reload answers 500."""

    def __init__(self, fail: str | None = None, no_reset: bool = False) -> None:
        self.calls: list[str] = []
        self.asked = 0  # one-request updates asked for (answered 404, as by vLLM without the extension)
        self.fail, self.no_reset = fail, no_reset

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/sleep":
            assert request.url.params["level"] == "0"  # the scheduler's pause, no memory released
            self.calls.append(f"pause:{request.url.params['mode']}")
        elif path == "/reset_prefix_cache":
            assert request.url.params["reset_running_requests"] == "true"
            self.calls.append("reset")
            return httpx.Response(200, json={"success": not self.no_reset})
        elif path == "/collective_rpc":
            weights = httpx.Request("POST", "x", content=request.content).read()
            name = "bad" if self.fail and self.fail.encode() in weights else "ok"
            self.calls.append(f"reload:{name}")
            if name == "bad":
                return httpx.Response(500, json={"error": "no such checkpoint"})
        elif path == "/update_weight_version":
            self.calls.append("tag:" + request.content.decode().split('"new_version":')[1].strip(' "}'))
        elif path == "/atdp/update_weights":  # a vLLM started without the extension
            self.asked += 1
            return httpx.Response(404, json={"detail": "Not Found"})
        else:
            self.calls.append(path.strip("/"))
        return httpx.Response(200, json={})


def _run(engine: Engine, checkpoint: str, **kw):
    async def go():
        async with serving(engine) as (base, client):
            return await load_weights(client, ReplicaPool([base]).replicas[0], checkpoint, "v1", timeout_s=5, **kw)

    return asyncio.run(go())


def test_keep_mode_pauses_with_keep_and_a_failed_reload_puts_the_old_weights_back_before_resuming():
    engine = Engine()
    timings = _run(engine, "/ckpt/v1", mode="keep", fallback=("/ckpt/base", "base"))
    assert engine.calls == ["pause:keep", "reset", "reload:ok", "tag:v1", "resume"]
    assert timings.window_s >= 0 and set(timings.steps) == {
        "sleep", "reset_prefix_cache", "collective_rpc", "update_weight_version", "resume"}

    engine = Engine(fail="/ckpt/v1")
    with pytest.raises(SwapError, match=r"reload_weights\(/ckpt/v1\) answered 500"):
        _run(engine, "/ckpt/v1", mode="keep", fallback=("/ckpt/base", "base"))
    # the tag goes beside the reload (the engine is paused: nothing is stamped with it yet); after the
    # failure the old weights and their tag are back before the engine resumes
    assert engine.calls == ["pause:keep", "reset", "reload:bad", "tag:v1", "reload:ok", "tag:base", "resume"]


def test_a_prefix_cache_that_would_not_reset_fails_the_update_and_the_old_weights_come_back():
    # The old weights' keys and values would otherwise be read by the new ones.
    engine = Engine(no_reset=True)
    with pytest.raises(SwapError, match="reset_prefix_cache"):
        _run(engine, "/ckpt/v1", mode="keep", fallback=("/ckpt/base", "base"))
    # the reload ran beside the reset and finished before the old weights were put back
    assert engine.calls == ["pause:keep", "reset", "reload:ok", "tag:v1", "reload:ok", "tag:base", "resume"]


def test_drain_mode_waits_and_always_resumes():
    engine = Engine(fail="/ckpt/v1")
    with pytest.raises(SwapError):
        _run(engine, "/ckpt/v1")
    # drain: the caller restores behind its closed gate (proxy.rollout.swap); the engine is never left paused
    # (its restore tags the old version again: tests/integration/test_versions.py)
    assert engine.calls == ["pause:wait", "reset", "reload:bad", "tag:v1", "resume"]


def test_a_call_across_two_updates_names_the_first_and_the_last_version():
    pool = ReplicaPool(["http://e:1"])
    r = pool.replicas[0]
    r.begin_window("v1")
    lease = _lease(pool)
    r.end_window("v1")
    r.begin_window("v2")
    assert lease.window() == ("base", "v2")
