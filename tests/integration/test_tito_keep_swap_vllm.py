"""A keep-mode swap while a token-in-token-out call generates (real vLLM CPU, the tiny model): the
engine reports which output tokens each weight version sampled (`WeightVersionSpan`), so the step
that spans the update carries both versions exactly, as the engine reports them, and stays eligible
(a chat-completions call in the same place is `version_ambiguous`: test_swap_keep_vllm.py).

Where the update lands is not left to timing: the test waits until the engine's own counter of
generated tokens shows the long call generating, freezes the engine there (`/pause?mode=keep`, as
the proxy's swap does), then posts the swap, which pauses again, reloads, tags and resumes. Frozen,
the call cannot end before the update; whether it had begun is read from the engine's spans (the
stored step), and an attempt where it had not is tried again. The proxy's own timings are printed
(`routes_s`, `window_s`): a swap that waited for the call shows there (docs/vllm-notes.md).
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


def _generated(base_url: str) -> float:
    """The engine's count of generated tokens (Prometheus counter, updated as each step's output arrives)."""
    text = httpx.get(base_url + "/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


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
        for attempt in range(5):
            result: dict = {}
            worker = threading.Thread(target=_long_call, args=(client, f"tito-keep-swap-{attempt}", result))
            worker.start()
            deadline = time.monotonic() + 120
            while "t0" not in result:
                assert time.monotonic() < deadline and worker.is_alive(), result
                time.sleep(0.005)
            # The long call is generating once the engine has counted some of its tokens (nothing else
            # generates on the test engine now); then the engine is frozen where it is.
            base = seen = _generated(engine)
            while seen < base + 16 and worker.is_alive():
                assert time.monotonic() < deadline, "the engine counted no generated tokens for 120 s"
                time.sleep(0.01)
                seen = _generated(engine)
            paused_at, counted = time.monotonic(), seen - base
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
                step = s.get(t.Step, result["step"])
                assert step is not None and step.prompt_path == "tito"
                versions, stored = unrle(step.output_versions), step.output_versions
                n_ids, eligibility, reason = len(step.output_token_ids), step.eligibility, step.eligibility_reason
            print(f"attempt {attempt + 1}: call {result['t0'] - swap_t0:+.2f} .. {result['t1'] - swap_t0:+.2f} s, "
                  f"engine paused at {paused_at - swap_t0:+.2f} s ({counted:.0f} tokens counted), swap 0 .. {swap_t1 - swap_t0:.2f} s "
                  f"(window {swap['replicas'][0]['window_s']} s, routes {swap['replicas'][0]['routes_s']}); "
                  f"{stored}")
            if len(set(versions)) > 1:  # it generated across the update
                break
            # one version: the call had not begun generating, or had ended, when the engine froze
        else:
            pytest.fail(f"no attempt's call generated across the update (last: {stored})")

        # exactly the tokens of both versions, in order, as the engine reported them
        assert len(versions) == n_ids == LONG_TOKENS
        runs = [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]
        assert runs == [old, new], stored
        assert versions.count(old) >= 16  # the engine had counted them before it froze
        assert eligibility == Eligibility.eligible, reason
    finally:
        httpx.post(engine + "/resume", timeout=60)  # never leave the shared engine frozen
        swap_weights(engine, vllm_server.model_dir, "base")
