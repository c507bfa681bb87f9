"""Backpressure from a lagging writer: the proxy holds answered steps until the writer child makes
them durable; past ATDP_WRITER_HOLD_MB of them new calls get 503 with retry-after in the door's own
error format, nothing answered is lost, and calls go through again once the writer catches up. The
writer child is real and stopped with SIGSTOP (a CPU-starved writer, at the limit)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import httpx

from tests.integration.test_writer_supervision import _chat, _step_ids


def test_a_lagging_writer_turns_new_calls_away_and_loses_nothing(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url], writer_mode="process", writer_hold_mb=0.05)  # ~50 KB
    rec = proxy.state.recorder
    answered = []
    r = _chat(proxy.url, "before")
    assert r.status_code == 200
    answered.append(r.headers["x-atdp-step-id"])
    proxy.flush(60)
    os.kill(rec.pid, signal.SIGSTOP)
    refused = None
    try:
        for i in range(300):
            r = _chat(proxy.url, f"while the writer lags {i} {uuid.uuid4().hex}")
            if r.status_code != 200:
                refused = r
                break
            answered.append(r.headers["x-atdp-step-id"])
        assert refused is not None, "never refused: the proxy held every step, however many"
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "writer is behind" in refused.json()["error"]["message"]  # OpenAI's error object
        m = httpx.post(proxy.url + "/v1/messages", json={"model": "fake", "max_tokens": 8,
                                                          "messages": [{"role": "user", "content": "x"}]})
        assert m.status_code == 503 and m.json()["error"]["type"] == "overloaded_error"  # Anthropic's
        writer = httpx.get(proxy.url + "/healthz").json()["writer"]
        assert writer["held_mb"] >= 0.05 and writer["held"] == rec.pending == len(answered) - 1
        assert 3 <= len(answered) - 1 < 100  # a few KB a step against 50 KB
        assert "atdp_writer_held_bytes" in httpx.get(proxy.url + "/metrics").text
    finally:
        os.kill(rec.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while (rec.refusing() or rec.pending) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rec.refusing() is None and rec.pending == 0
    r = _chat(proxy.url, "after")
    assert r.status_code == 200
    answered.append(r.headers["x-atdp-step-id"])
    proxy.flush(60)
    assert _step_ids(factory, proxy.tenant) == set(answered)  # 0 lost
    assert rec.stats["overflow"] == 0  # nothing was redacted and spooled in the proxy itself
