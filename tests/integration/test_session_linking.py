"""Independent runs stay separate (#13): a call whose input equals an earlier call's joins that
call's session only as a retry, i.e. an identical request body within the retry window
(ATDP_RETRY_WINDOW_S); otherwise it starts its own session."""

from __future__ import annotations

import time

import httpx

SYSTEM = {"role": "system", "content": "You are the repository's coding agent. Follow AGENTS.md."}
FIRST = {"role": "user", "content": "fix the failing test in tests/test_io.py"}


def _call(proxy, **extra) -> str:
    r = httpx.post(proxy.v1 + "/chat/completions", timeout=30,
                   json={"model": "fake", "messages": [SYSTEM, FIRST], **extra})
    assert r.status_code == 200, r.text
    return r.headers["x-atdp-session-id"]


def test_same_opening_is_a_new_run_unless_it_is_a_retry(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url], retry_window_s=1.0)
    first = _call(proxy)
    assert _call(proxy) == first  # the same body again at once: a retry (or a parallel sample)
    assert _call(proxy, temperature=0.3) != first  # same opening, another request: another run
    time.sleep(1.3)
    later = _call(proxy)  # the same opening after the window: an independent run
    assert later != first
    assert _call(proxy) == later
