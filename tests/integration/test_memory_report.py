"""/healthz shows what grows with traffic: the proxy's RSS and its bounded caches (continuation keys,
token-in-token-out memory, canary arms) and its writer child's (contents known stored, steps'
redaction state, the token cache), as entries. A soak reads them beside RSS (bench/soak.py) to tell
a cache filling up to its bound from a leak."""

from __future__ import annotations

import uuid

import httpx

from tests.integration.test_writer_supervision import _chat


def test_healthz_reports_the_caches_of_proxy_and_writer(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url], writer_mode="process")
    before = httpx.get(proxy.url + "/healthz").json()
    for i in range(12):
        assert _chat(proxy.url, f"memory report {i} {uuid.uuid4().hex}").status_code == 200
    proxy.flush(60)
    after = httpx.get(proxy.url + "/healthz").json()

    mem = after["memory"]
    assert mem["rss_mb"] > 10  # the proxy's own resident set, from /proc
    grew = {k: after["memory"]["caches"][k] - before["memory"]["caches"][k] for k in mem["caches"]}
    assert grew["continuations"] == 12  # one key per answered call: 12 new sessions
    assert grew["canary_arms"] == 0  # no canary runs
    # The child's numbers come with its acknowledgements: the last one followed the last batch.
    w0, w1 = before["writer"]["caches"], after["writer"]["caches"]
    assert w1["steps_redaction_state"] - w0.get("steps_redaction_state", 0) == 12
    assert w1["contents_known"] - w0.get("contents_known", 0) >= 12  # each call's new message at least
    assert set(w1) >= {"outputs", "side_values", "token_steps", "tokens"}
