"""A keep-mode swap while a token-in-token-out call generates (real vLLM CPU, the tiny model): the
engine reports which output tokens each weight version sampled (`WeightVersionSpan`), so the step
that spans the update carries both versions exactly, as the engine reports them, and stays eligible
(a chat-completions call in the same place is `version_ambiguous`: test_swap_keep_vllm.py).
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


def _long_call(client: openai.OpenAI, session: str, result: dict) -> None:
    """Two turns: a forced tool call that ends by itself (a parent cut by max_tokens is rendered, not
    continued), then a long answer on the tito path."""
    sid = {"x-atdp-session-id": session}
    messages = [{"role": "user", "content": "count the files"}]
    try:
        first = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=64, extra_headers=sid,
            tool_choice={"type": "function", "function": {"name": "terminal"}})
        call = first.choices[0].message.tool_calls[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12\n"}]
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
    weights = [tiny_model_dir_b, vllm_server.model_dir]
    try:
        # The engine says nothing while it generates (its gauges lag, and on 2 cores its HTTP server may
        # answer only once generation ends), so the swap is sent a moment after the long call; an attempt
        # whose swap was not done before the call ended is set-up, not a result: tried again, later.
        for attempt in range(5):
            result: dict = {}
            worker = threading.Thread(target=_long_call, args=(client, f"tito-keep-swap-{attempt}", result))
            worker.start()
            deadline = time.monotonic() + 120
            while "t0" not in result:
                assert time.monotonic() < deadline and worker.is_alive(), result
                time.sleep(0.005)
            time.sleep(0.2 + 0.3 * attempt)  # render, render, then generate (~2-4 s for these tokens here)
            new, old = f"v{attempt + 1}", replica.version
            swap_t0 = time.monotonic()
            r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=120,
                           json={"checkpoint": str(weights[attempt % 2]), "name": new, "promote": "now"})
            swap_t1 = time.monotonic()
            assert r.status_code == 200, r.text
            assert r.json()["swap"]["replicas"][0]["mode"] == "keep"
            worker.join(300)
            assert "error" not in result and result["finish"] == "length", result
            print(f"attempt {attempt + 1}: call {result['t0'] - swap_t0:+.2f} .. {result['t1'] - swap_t0:+.2f} s, "
                  f"swap 0 .. {swap_t1 - swap_t0:.2f} s")
            if result["t1"] > swap_t1:  # still generating when the update was done: it spanned it
                break
        else:
            pytest.fail("the long call ended before every swap was done: the engine is too fast for this test")

        proxy.flush()
        with factory() as s:
            step = s.get(t.Step, result["step"])
            assert step is not None and step.prompt_path == "tito"
            versions = unrle(step.output_versions)
            assert len(versions) == len(step.output_token_ids) == LONG_TOKENS
            # exactly two runs, in order: the tokens sampled before the update, then after it
            runs = [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]
            assert runs == [old, new], step.output_versions
            assert step.eligibility == Eligibility.eligible, step.eligibility_reason
            print(f"spanning tito step (attempt {attempt + 1}): {step.output_versions}")
    finally:
        swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")
