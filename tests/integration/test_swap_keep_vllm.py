"""A keep-mode swap on the real engine (vLLM CPU, the tiny model): vLLM pauses with `keep`, the proxy's
gate stays open, calls in flight carry on across the update, none fails, even one running longer
than the drain and hold timeouts (lowered here to 2 s and 1 s: a drain swap would give up on it).

Chat completions carry no engine spans, so a call whose generation overlapped the update is never
stamped with one version: its tokens are labelled with both (`base|v1`) and its step is not eligible
(`version_ambiguous`). A call that ended before the swap began is exact `base`, one that began after
it ended exact `v1`. The test freezes the engine (`pause?mode=keep`) before the long call reaches it
and posts the swap 2.5 s later, so that call (and the load's calls sent meanwhile) is in flight across
the swap whatever the engine's speed; the swap's own pause, reload, tag and resume let it go on.
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

ADMIN = {"authorization": "Bearer admin-test-key"}
LONG_TOKENS = 1500

pytestmark = pytest.mark.vllm


def _load(proxy, stop: threading.Event, calls: list, errors: list, k: int) -> None:
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=120)
    i = 0
    while not stop.is_set():
        i += 1
        t0 = time.monotonic()
        try:
            kw = {"model": "tiny", "messages": [{"role": "user", "content": f"w{k} q{i}"}], "max_tokens": 48,
                  "temperature": 0, "extra_body": {"ignore_eos": True}}
            raw = client.chat.completions.with_raw_response.create(stream=bool(i % 2), **kw)
            out = raw.parse()
            if i % 2:
                assert list(out)
            calls.append((raw.headers["x-atdp-step-id"], t0, time.monotonic()))
        except Exception as e:  # any failure is a test failure: collected and asserted on
            errors.append(f"{type(e).__name__}: {e}")


def test_keep_swap_under_load_fails_nothing_and_never_stamps_a_spanning_call_with_one_version(
        start_proxy, vllm_server, tiny_model_dir_b, own_db):
    from tests.vllm_fixtures import swap_weights

    url, factory = own_db
    proxy = start_proxy([vllm_server.base_url], database_url=url, swap_mode="keep", swap_drain_timeout_s=2.0,
                        swap_hold_timeout_s=1.0)
    assert proxy.versions.ready.wait(60)
    proxy.state.pool.hold_timeout_s = 1.0
    stop, calls, errors = threading.Event(), [], []
    long_result: dict = {}

    def long_call() -> None:
        client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=300)
        t0 = time.monotonic()
        long_result["sent"] = t0
        try:
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "a long one"}], max_tokens=LONG_TOKENS,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            long_result["step"] = raw.headers["x-atdp-step-id"]
            stream = raw.parse()
            n = 0
            for chunk in stream:
                n += 1
                long_result.setdefault("first", time.monotonic())
                if chunk.choices and chunk.choices[0].finish_reason:
                    long_result["finish"] = chunk.choices[0].finish_reason
            long_result.update(chunks=n, t0=t0, t1=time.monotonic())
        except Exception as e:
            errors.append(f"long: {type(e).__name__}: {e}")

    try:
        workers = [threading.Thread(target=_load, args=(proxy, stop, calls, errors, k)) for k in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 120
        while len(calls) < 6:
            assert time.monotonic() < deadline and not errors, errors[:3]
            time.sleep(0.05)
        # The engine frozen before the long call reaches it: the call (and the load's calls sent
        # meanwhile) wait in its queue, so they are in flight when the swap begins, however fast the
        # engine generates and however late its busy API server takes the swap's own /pause.
        httpx.post(vllm_server.base_url + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
        long = threading.Thread(target=long_call)
        long.start()
        while "sent" not in long_result:
            time.sleep(0.005)
        time.sleep(2.5)  # longer than the lowered drain and hold timeouts
        assert long.is_alive() and not errors, (long_result, errors[:3])
        swap_t0 = time.monotonic()
        r = httpx.post(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=120,
                       json={"checkpoint": str(tiny_model_dir_b), "name": "v1", "promote": "now"})
        swap_t1 = time.monotonic()
        assert r.status_code == 200, r.text
        swap = r.json()["swap"]
        assert swap["ok"] and swap["replicas"][0]["mode"] == "keep", swap
        # the engine serves the one-request update (proxy/rollout/vllm_ext: VLLMServer loads it)
        assert "atdp/update_weights" in swap["replicas"][0]["routes_s"], swap
        n = len(calls)
        while len(calls) < n + 6:  # traffic on the new weights too
            assert time.monotonic() < deadline and not errors, errors[:3]
            time.sleep(0.05)
        stop.set()
        for w in workers:
            w.join(120)
        long.join(300)
        assert not errors, errors[:5]
        # the long call ran across the swap and past the lowered drain and hold timeouts, and finished:
        # sent before the swap began, its first token came only after it began (the engine was frozen
        # until the swap's resume). Not "ended after the POST answered": the test's process, which also
        # hosts the proxy, sometimes stalls for 2-3 s around the swap (seen before and after the
        # pause moved to /sleep), and a tiny model finishes 1,200 tokens within such a stall.
        assert long_result["t0"] < swap_t0 < long_result["first"], (long_result, swap_t0, swap_t1)
        assert long_result["t1"] - long_result["t0"] > 2.0 and long_result["finish"] == "length"
        assert httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json()["weight_version"] == "v1"

        proxy.flush()
        with factory() as s:
            steps = {st.id: st for st in s.query(t.Step).filter(t.Step.tenant_id == proxy.tenant)}
        assert len(steps) == len(calls) + 1
        long_step = steps[long_result["step"]]
        assert len(long_step.output_token_ids) == LONG_TOKENS
        assert set(unrle(long_step.output_versions)) == {"base|v1"}
        assert long_step.eligibility == Eligibility.debug_only
        assert long_step.eligibility_reason == "version_ambiguous: base -> v1"
        before = after = spanning = 0
        for prompt, t0, t1 in calls:
            st = steps[prompt]
            versions = set(unrle(st.output_versions))
            if t1 < swap_t0:  # over before the swap began: one version, exact
                before += 1
                assert versions == {"base"} and st.model_version == "base", (prompt, versions)
                assert st.eligibility == Eligibility.eligible
            elif t0 > swap_t1:  # began after the new version was stamped
                after += 1
                assert versions == {"v1"} and st.model_version == "v1", (prompt, versions)
                assert st.eligibility == Eligibility.eligible
            elif t0 < swap_t0 and t1 > swap_t1:  # surely spanned the update
                spanning += 1
                assert versions == {"base|v1"} and st.eligibility_reason.startswith("version_ambiguous")
            else:  # overlapped the POST only in part: exact or ambiguous, never the other single version
                assert versions in ({"base"}, {"v1"}, {"base|v1"}), versions
                if versions == {"base|v1"}:
                    assert st.eligibility == Eligibility.debug_only
        print(f"keep swap {swap['seconds']:.3f} s, window {swap['replicas'][0]['window_s']} s; calls before {before}, "
              f"after {after}, spanning {spanning}, long call {long_result['t1'] - long_result['t0']:.1f} s")
        assert before and after
    finally:
        stop.set()
        httpx.post(vllm_server.base_url + "/resume", timeout=60)  # never leave the shared engine frozen
        # The server is shared by the test session: whatever happened, it serves seed 0 again.
        swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")

