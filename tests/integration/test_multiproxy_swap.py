"""A swap driven by one proxy closes every proxy's gate (issue 17, item 1: swap coordination), or in
keep mode opens a swap window on every proxy (issue 16, item 3).

Three proxies share one database and two scripted replicas; a client's calls go round robin over
the proxies during a swap driven by one of them. No call fails, and every stored step is stamped
with the version of the weights that wrote it, whichever proxy served it; in keep mode a step that
overlapped the update on any proxy is labelled with both versions and not eligible instead.
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import openai
import pytest

from proxy.store import tables as t
from proxy.store.tokens import unrle
from tests.fake_vllm import FakeVLLM, ServerThread

ADMIN = {"authorization": "Bearer admin-test-key"}


def _traffic(proxies, stop: threading.Event, results: list, errors: list, offset: int) -> None:
    clients = [openai.OpenAI(base_url=p.v1, api_key="x", max_retries=0, timeout=60) for p in proxies]
    for i in itertools.count(offset):
        if stop.is_set():
            return
        client = clients[i % len(clients)]
        messages = [{"role": "user", "content": f"q{i}"}]
        try:
            if i % 2:
                chunks = list(client.chat.completions.create(model="fake", messages=messages, stream=True))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                text = client.chat.completions.create(model="fake", messages=messages).choices[0].message.content
            results.append(text)
        except Exception as e:  # any failure is a test failure: collected and asserted on
            errors.append(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("mode", ["drain", "keep"])
def test_swap_through_three_proxies_under_round_robin_load(start_proxy, own_db, mode):
    url, factory = own_db
    fakes, servers = [], []
    for _ in range(2):
        fake = FakeVLLM()
        fake.chunk_delay = 0.002  # a model generating: calls are in flight when a gate closes
        servers.append(ServerThread(fake).start())
        fake.url = servers[-1].url
        fakes.append(fake)
    try:
        tenant = "t-swap3"
        proxies = []
        for _ in range(3):
            p = start_proxy([f.url for f in fakes], database_url=url, tenant=f"{tenant}-{mode}", swap_mode=mode)
            assert p.versions.ready.wait(30)
            proxies.append(p)
        deadline = time.monotonic() + 30
        while not all(p.versions.bus is not None and p.versions.bus.ready.is_set() for p in proxies):
            assert time.monotonic() < deadline, "swap listeners never ready"
            time.sleep(0.05)
        stop, results, errors = threading.Event(), [], []
        workers = [threading.Thread(target=_traffic, args=(proxies, stop, results, errors, k)) for k in range(6)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30
        while len(results) < 12:  # traffic on the old version first
            assert time.monotonic() < deadline and not errors, errors[:5]
            time.sleep(0.05)
        r = httpx.post(proxies[0].url + "/atdp/v1/versions", headers=ADMIN, timeout=120,
                       json={"checkpoint": "/ckpt/w1", "name": "v1", "promote": "now"})
        n = len(results)
        while len(results) < n + 12:  # and on the new one
            assert time.monotonic() < deadline + 30 and not errors, errors[:5]
            time.sleep(0.05)
        stop.set()
        for w in workers:
            w.join(60)
        assert r.status_code == 200, r.text
        assert r.json()["swap"]["ok"], r.json()
        assert {x["mode"] for x in r.json()["swap"]["replicas"]} == {mode}
        assert not errors, errors[:5]
        assert all(f.weights == "w1" for f in fakes)
        # Every proxy stamps the new version now, not only the driver.
        assert all(rep.version == "v1" for p in proxies for rep in p.state.pool.replicas)

        weights_of = {"base": "w0", "v1": "w1"}
        steps: list[t.Step] = []
        for p in proxies:
            p.flush()
        with factory() as s:
            steps = list(s.query(t.Step).filter(t.Step.tenant_id == f"{tenant}-{mode}"))
        assert len(steps) == len(results) >= 24
        ambiguous = [st for st in steps if set(unrle(st.output_versions)) == {"base|v1"}]
        assert mode == "keep" or not ambiguous
        assert all(st.eligibility == "debug_only" and st.eligibility_reason == "version_ambiguous: base -> v1"
                   for st in ambiguous)
        wrong = [(st.model_version, bytes(st.output_token_ids).decode()[:6]) for st in steps if st not in ambiguous
                 and (not bytes(st.output_token_ids).decode().startswith(f"[{weights_of[st.model_version]}] ")
                      or set(unrle(st.output_versions)) != {st.model_version})]
        assert wrong == []
        print(f"{mode}: {len(steps)} steps, {len(ambiguous)} ambiguous")
        assert {st.model_version for st in steps} == {"base", "v1"}
        assert len({st.upstream for st in steps}) == 2
    finally:
        for s in servers:
            s.stop()


def test_a_second_driver_is_refused_while_one_swaps(start_proxy, own_db, fake_upstream):
    url, _ = own_db
    a = start_proxy([fake_upstream.url], database_url=url, tenant="t-busy")
    b = start_proxy([fake_upstream.url], database_url=url, tenant="t-busy")
    assert a.versions.ready.wait(30) and b.versions.ready.wait(30)
    # Hold the driver lock from outside (as a swapping proxy would) and ask b to swap.
    import psycopg

    from proxy.rollout.swapbus import DRIVER_KEY
    from proxy.store.links import libpq_url

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (DRIVER_KEY,))
        deadline = time.monotonic() + 30
        while not (b.versions.bus is not None and b.versions.bus.ready.is_set()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(b.url + "/atdp/v1/versions", headers=ADMIN, timeout=60,
                       json={"checkpoint": "/ckpt/w9", "name": "v9", "promote": "now"})
    assert r.status_code == 409 and "another proxy is swapping" in r.text, r.text
    # Not recorded as a failure of v9: it can be swapped to once the other swap is done.
    listing = httpx.get(b.url + "/atdp/v1/versions", headers=ADMIN, timeout=10).json()
    assert all(v["status"] != "failed" for v in listing["data"])
    assert fake_upstream.weights == "w0"  # nothing was reloaded


def test_a_version_promoted_on_one_proxy_is_the_serving_version_of_every_proxy(start_proxy, own_db):
    """Each proxy remembers the serving version: the base of its gates and swaps, what a failed swap
    restores, a new version's parent. A swap driven by another proxy is announced. Before, the other
    proxy kept the old one: its next failed swap "restored" base on the first replica and stamped
    both replicas base, while the second still held v1's weights (measured with this test)."""
    url, _ = own_db
    fakes = [FakeVLLM(), FakeVLLM()]
    servers = [ServerThread(f).start() for f in fakes]
    try:
        a, b = (start_proxy([s.url for s in servers], database_url=url, tenant="t-serving") for _ in range(2))
        deadline = time.monotonic() + 30
        while not all(p.versions.ready.is_set() and p.versions.bus is not None and p.versions.bus.ready.is_set()
                      for p in (a, b)):
            assert time.monotonic() < deadline, "proxies never ready"
            time.sleep(0.05)
        r = httpx.post(a.url + "/atdp/v1/versions", headers=ADMIN, timeout=120,
                       json={"checkpoint": "/ckpt/w1", "name": "v1", "promote": "now"})
        assert r.status_code == 200, r.text
        v1 = r.json()["id"]
        while b.versions.current is None or b.versions.current.name != "v1":
            assert time.monotonic() < deadline, "proxy B never heard that v1 serves"
            time.sleep(0.05)
        assert httpx.get(b.url + "/atdp/v1/versions", headers=ADMIN).json()["serving"] == "v1"

        fakes[1].fail_reload = True  # B's swap to v2 fails on the second replica: v1 comes back everywhere
        r = httpx.post(b.url + "/atdp/v1/versions", headers=ADMIN, timeout=120,
                       json={"checkpoint": "/ckpt/w2", "name": "v2", "promote": "now"})
        assert r.status_code == 502, r.text
        assert r.json()["parent"] == v1
        assert [f.weights for f in fakes] == ["w1", "w1"] and [f.version for f in fakes] == ["v1", "v1"]
        assert [rep.version for p in (a, b) for rep in p.state.pool.replicas] == ["v1"] * 4
        assert a.versions.current.name == b.versions.current.name == "v1"
    finally:
        for s in servers:
            s.stop()
