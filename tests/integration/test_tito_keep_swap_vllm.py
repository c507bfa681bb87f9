"""A keep-mode swap while a token-in-token-out call generates (real vLLM CPU, the tiny model): the
engine reports which output tokens each weight version sampled (`WeightVersionSpan`), so the step
that spans the update carries both versions exactly, as the engine reports them, and stays eligible
(a chat-completions call in the same place is `version_ambiguous`: test_swap_keep_vllm.py).

Where the update lands is not left to timing. On a 2-core machine vLLM's API server answers control
requests late while it generates (its event loop is busy with the outputs; a `/pause` sent mid-call
was seen to return only when the call ended, and the engine's token counter moves only when a
non-streamed request ends), and on a quiet machine the tiny model generates 1,200 tokens in about a
second. So the test freezes the engine (`/pause?mode=keep`) before the long call reaches it; the call
waits in the engine's queue; the test resumes the engine and freezes it again a moment later, mid
generation, then posts the swap, which pauses again, reloads, tags and resumes. Frozen, the call
cannot end before the update. How many tokens the old version sampled is read from the engine's
spans (the stored step): none (the call had not reached the engine, or the gap was too short) or all
(the second freeze came late) is tried again with a longer or shorter gap. The proxy's own timings
are printed (`routes_s`, `window_s`): a swap that waited for the call shows there.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from atdp_schema.models import Eligibility
from proxy.store import tables as t
from proxy.store.tokens import unrle
from tests import agent_traffic as traffic

ADMIN = {"authorization": "Bearer admin-test-key"}
LONG_TOKENS = 1200  # within the tiny model's context after the tool-call prompt
TOOLS = [{"type": "function", "function": {"name": "terminal", "description": "Run a shell command",
                                             "parameters": traffic.TERMINAL}}]  # fmt: skip

pytestmark = pytest.mark.vllm


def _long_call(client: openai.OpenAI, session: str, result: dict, frozen: threading.Event) -> None:
    """Two turns: a forced tool call that ends by itself (a parent cut by max_tokens is rendered, not
    continued), then, once the test has frozen the engine (`frozen`), a long answer on the tito path."""
    sid = {"x-atdp-session-id": session}
    messages = [{"role": "user", "content": "count the files"}]
    try:
        first = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=64, extra_headers=sid,
            tool_choice={"type": "function", "function": {"name": "terminal"}})
        call = first.choices[0].message.tool_calls[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12\n"}]
        result["ready"] = True
        assert frozen.wait(120)
        result["t0"] = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=LONG_TOKENS,
            temperature=0, extra_headers=sid, extra_body={"ignore_eos": True})
        result["step"] = raw.headers["x-atdp-step-id"]
        result["finish"] = raw.parse().choices[0].finish_reason
        result["t1"] = time.monotonic()
    except Exception as e:  # asserted on by the caller
        result["error"] = f"{type(e).__name__}: {e}"


def test_a_tito_call_spanning_a_keep_swap_carries_both_versions_as_the_engine_reports(
        start_proxy, vllm_server, tiny_model_dir_b, own_db) -> None:
    from tests.vllm_fixtures import swap_weights

    url, factory = own_db
    proxy = start_proxy([vllm_server.base_url], database_url=url, swap_mode="keep")
    assert proxy.versions.ready.wait(60)
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=300)
    replica = proxy.state.pool.replicas[0]
    engine = vllm_server.base_url
    weights = [tiny_model_dir_b, vllm_server.model_dir]
    try:
        settle, gap = 1.0, 0.005
        for attempt in range(8):
            result: dict = {}
            frozen = threading.Event()
            worker = threading.Thread(target=_long_call, args=(client, f"tito-keep-swap-{attempt}", result, frozen))
            worker.start()
            deadline = time.monotonic() + 120
            while "ready" not in result:  # its first turn answered
                assert time.monotonic() < deadline and worker.is_alive(), result
                time.sleep(0.005)
            httpx.post(engine + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
            frozen.set()
            while "t0" not in result:
                assert time.monotonic() < deadline and worker.is_alive(), result
                time.sleep(0.005)
            time.sleep(settle)  # its two renders (the engine's API server answers those while frozen)
            assert worker.is_alive(), result  # a frozen engine cannot have answered it
            httpx.post(engine + "/resume", timeout=60).raise_for_status()
            time.sleep(gap)
            paused_at = time.monotonic()
            httpx.post(engine + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
            new, old = f"v{attempt + 1}", replica.version
            swap_t0 = time.monotonic()
            r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=120,
                           json={"checkpoint": str(weights[attempt % 2]), "name": new, "promote": "now"})
            swap_t1 = time.monotonic()
            assert r.status_code == 200, r.text
            swap = r.json()["swap"]
            assert swap["ok"] and swap["replicas"][0]["mode"] == "keep", swap
            worker.join(300)
            assert "error" not in result and result["finish"] == "length", result
            proxy.flush()
            with factory() as s:
                step = t.get_step(s, result["step"])
                assert step is not None and step.prompt_path == "tito"
                versions, stored = unrle(step.output_versions), step.output_versions
                n_ids, eligibility, reason = len(step.output_token_ids), step.eligibility, step.eligibility_reason
            print(f"attempt {attempt + 1}: call {result['t0'] - swap_t0:+.2f} .. {result['t1'] - swap_t0:+.2f} s, "
                  f"engine refrozen at {paused_at - swap_t0:+.2f} s after a {gap * 1000:.0f} ms run, swap 0 .. {swap_t1 - swap_t0:.2f} s "
                  f"(window {swap['replicas'][0]['window_s']} s, routes {swap['replicas'][0]['routes_s']}); "
                  f"{stored}")
            if len(set(versions)) > 1:  # it generated across the update
                break
            if versions.count(old) == 0:  # not in the engine yet when it ran, or too short a run
                settle, gap = settle * 2, gap * 3
            else:  # all of it before the second freeze landed
                gap /= 3
        else:
            pytest.fail(f"no attempt's call generated across the update (last: {stored})")

        # exactly the tokens of both versions, in order, as the engine reported them
        assert len(versions) == n_ids == LONG_TOKENS
        runs = [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]
        assert runs == [old, new], stored
        assert eligibility == Eligibility.eligible, reason
    finally:
        httpx.post(engine + "/resume", timeout=60)  # never leave the shared engine frozen
        swap_weights(engine, vllm_server.model_dir, "base")
