"""A keep-mode swap while a token-in-token-out call generates (real vLLM CPU, the tiny model): the
engine reports which output tokens each weight version sampled (`WeightVersionSpan`), so the step
that spans the update carries both versions exactly, as the engine reports them, and stays eligible
(a chat-completions call in the same place is `version_ambiguous`: test_swap_keep_vllm.py).
"""

from __future__ import annotations

import re
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
LONG_TOKENS = 1500
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.M)

pytestmark = pytest.mark.vllm


def _running(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    return sum(float(v) for v in RUNNING.findall(text))


def test_a_tito_call_spanning_a_keep_swap_carries_both_versions_as_the_engine_reports(
        start_proxy, vllm_server, tiny_model_dir_b, own_db) -> None:
    from tests.vllm_fixtures import swap_weights

    url, factory = own_db
    proxy = start_proxy([vllm_server.base_url], database_url=url, swap_mode="keep")
    assert proxy.versions.ready.wait(60)
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=300)
    sid = {"x-atdp-session-id": "tito-keep-swap"}
    # A first turn that ends by itself (a forced tool call): a parent cut by max_tokens is rendered.
    tools = [{"type": "function", "function": {"name": "terminal", "description": "Run a shell command",
                                                  "parameters": traffic.TERMINAL}}]  # fmt: skip
    messages = [{"role": "user", "content": "count the files"}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, temperature=0, max_tokens=64, extra_headers=sid,
        tool_choice={"type": "function", "function": {"name": "terminal"}})
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "12\n"}]
    result: dict = {}

    def long_call() -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, tools=tools, tool_choice="none", max_tokens=LONG_TOKENS,
                temperature=0, extra_headers=sid, extra_body={"ignore_eos": True})
            result["step"] = raw.headers["x-atdp-step-id"]
            result["finish"] = raw.parse().choices[0].finish_reason
        except Exception as e:  # asserted on below
            result["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=long_call)
    try:
        worker.start()
        deadline = time.monotonic() + 120
        while _running(vllm_server.base_url) < 1:  # the long call is generating in the engine
            assert time.monotonic() < deadline and worker.is_alive(), result
            time.sleep(0.01)
        r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=120,
                       json={"checkpoint": str(tiny_model_dir_b), "name": "v1", "promote": "now"})
        assert r.status_code == 200, r.text
        assert r.json()["swap"]["replicas"][0]["mode"] == "keep"
        worker.join(300)
        assert "error" not in result and result["finish"] == "length", result

        proxy.flush()
        with factory() as s:
            step = s.get(t.Step, result["step"])
            assert step is not None and step.prompt_path == "tito"
            versions = unrle(step.output_versions)
            assert len(versions) == len(step.output_token_ids) == LONG_TOKENS
            # exactly two runs, in order: the tokens sampled before the update, then after it
            runs = [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]
            assert runs == ["base", "v1"], step.output_versions
            assert step.eligibility == Eligibility.eligible, step.eligibility_reason
            print(f"spanning tito step: {step.output_versions}")
    finally:
        worker.join(300)
        swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")
