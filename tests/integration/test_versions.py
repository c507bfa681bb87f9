"""Versioned weight swaps through the proxy: exact per-token versions, no failed requests, rollback.

The scripted upstream (tests/fake_vllm.py) prefixes every answer with the name of the weights folder
it loaded last, so each stored step says which weights produced it; the real-vLLM test tells the
seed-0 and seed-1 tiny checkpoints apart by their greedy tokens.
Each test gets its own database: model versions are global to a deployment.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.store import tables as t
from proxy.store.tokens import rebuild_prompt_ids, unrle
from tests.fake_vllm import FakeVLLM, ServerThread

ADMIN = {"authorization": "Bearer admin-test-key"}


class TimedFake(FakeVLLM):
    """The scripted upstream, noting when it was paused (to check replicas swap one at a time)."""

    def __init__(self, log: list, name: str) -> None:
        super().__init__()
        self.log, self.name = log, name

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in ("/pause", "/resume"):
            self.log.append((time.monotonic(), self.name, scope["path"]))
        await super().__call__(scope, receive, send)


@pytest.fixture
def fakes():
    log: list = []
    servers, upstreams = [], []
    for name in ("a", "b"):
        fake = TimedFake(log, name)
        server = ServerThread(fake).start()
        fake.url = server.url
        servers.append(server)
        upstreams.append(fake)
    yield upstreams, log
    for s in servers:
        s.stop()


def _start(start_proxy, upstreams, url):
    proxy = start_proxy([u.url for u in upstreams], database_url=url)
    assert proxy.versions.ready.wait(30)
    return proxy


def _versions(proxy) -> dict:
    r = httpx.get(proxy.url + "/atdp/v1/versions", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _swap(proxy, checkpoint: str, name: str | None = None, timeout: float = 120) -> httpx.Response:
    # The operator override: these tests are about the swap itself, not the gates in front of it.
    body = {"checkpoint": checkpoint, "promote": "now", **({"name": name} if name else {})}
    return httpx.post(proxy.url + "/atdp/v1/versions", json=body, headers=ADMIN, timeout=timeout)


def _traffic(proxy, stop: threading.Event, results: list, errors: list, *, model: str, max_tokens: int = 16,
             prompts: list[str] | None = None, index: int = 0) -> None:
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=120)
    i = 0
    while not stop.is_set():
        prompt = (prompts or ["hello"])[(i + index) % len(prompts or ["hello"])]
        stream = (i + index) % 2 == 1
        try:
            messages = [{"role": "user", "content": prompt}]
            if stream:
                chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                             max_tokens=max_tokens, stream=True))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                r = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                   max_tokens=max_tokens)
                text = r.choices[0].message.content
            results.append((prompt, text))
        except Exception as e:  # any failure is a test failure: collected and asserted on
            errors.append(f"{type(e).__name__}: {e}")
        i += 1


def test_startup_registers_base_and_stamps_replicas(start_proxy, fakes, own_db):
    upstreams, _ = fakes
    url, factory = own_db
    proxy = _start(start_proxy, upstreams, url)
    listing = _versions(proxy)
    assert listing["serving"] == "base"
    (base,) = listing["data"]
    assert base["status"] == "serving" and base["checkpoint"] == "/models/fake"  # GET /v1/models root
    assert [r["version"] for r in listing["replicas"]] == ["base", "base"]
    assert all(u.version == "base" for u in upstreams)  # update_weight_version pushed to vLLM
    # admin only
    assert httpx.get(proxy.url + "/atdp/v1/versions", timeout=5).status_code == 401


def test_swap_two_replicas_one_at_a_time_with_held_requests(start_proxy, fakes, own_db, factory):
    upstreams, log = fakes
    url, own_factory = own_db
    proxy = _start(start_proxy, upstreams, url)
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=60)

    # A slow call is in flight when the swap starts: the swap waits for it (drain), it is not cut.
    slow_result: list = []
    slow = threading.Thread(target=lambda: slow_result.append(c.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "#slow 1.0"}])))
    slow.start()
    time.sleep(0.2)
    stop, results, errors = threading.Event(), [], []
    workers = [threading.Thread(target=_traffic, args=(proxy, stop, results, errors),
                                kwargs={"model": "fake", "prompts": [f"q{k}" for k in range(5)], "index": k})
               for k in range(4)]
    for w in workers:
        w.start()
    r = _swap(proxy, "/ckpt/w1", name="v1")
    time.sleep(0.3)
    stop.set()
    for w in workers + [slow]:
        w.join(60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "serving" and body["name"] == "v1" and body["swap"]["ok"]
    assert [x["url"] for x in body["swap"]["replicas"]] == [u.url for u in upstreams]
    assert not errors and len(results) > 10
    assert slow_result and slow_result[0].choices[0].message.content == "[w0] slow answer"

    # One at a time: replica b paused only after replica a resumed.
    events = [(name, path) for _, name, path in sorted(log)]
    assert events == [("a", "/pause"), ("a", "/resume"), ("b", "/pause"), ("b", "/resume")]
    assert all(u.weights == "w1" and u.version == "v1" for u in upstreams)

    # Every stored step: its per-token versions are the version of the weights that wrote its text.
    weights_of = {"base": "w0", "v1": "w1"}
    steps = proxy.steps(own_factory)
    assert len(steps) == len(results) + 1
    seen = set()
    for st in steps:
        text = bytes(st.output_token_ids).decode()
        versions = set(unrle(st.output_versions))
        assert versions == {st.model_version}, st.id
        assert text.startswith(f"[{weights_of[st.model_version]}] "), (text, st.model_version)
        seen.add(st.model_version)
    assert seen == {"base", "v1"}  # traffic on both sides of the swap

    listing = _versions(proxy)
    status = {v["name"]: v["status"] for v in listing["data"]}
    assert status == {"base": "retired", "v1": "serving"}


def test_failed_swap_keeps_old_version_everywhere_and_rollback(start_proxy, fakes, own_db):
    upstreams, _ = fakes
    url, factory = own_db
    proxy = _start(start_proxy, upstreams, url)
    assert _swap(proxy, "/ckpt/w1", name="v1").status_code == 200

    # A candidate with lineage whose steps were marked trained (as the trainer registers it).
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "train on me"}])
    (step,) = proxy.steps(factory)
    with factory() as s, s.begin():
        s.add(t.ModelVersion(id="cand-2", name="v2", checkpoint="/ckpt/w2", status="candidate", metrics={}))
        s.flush()
        s.add(t.VersionLineage(version_id="cand-2", step_id=step.id, session_id=step.session_id, reward=1.0,
                               advantage=0.5))
        s.get(t.Step, step.id).trained_version_id = "cand-2"

    upstreams[1].fail_reload = True  # the second replica cannot load it
    r = _swap(proxy, "/ckpt/w2", name="v2")
    assert r.status_code == 502
    body = r.json()
    assert body["status"] == "failed" and "reload_weights" in body["swap"]["error"]
    # Old version everywhere: replica a was swapped then restored; b restored after the failure.
    assert [u.weights for u in upstreams] == ["w1", "w1"] and upstreams[0].version == "v1"
    assert [r.version for r in proxy.state.pool.replicas] == ["v1", "v1"]
    assert all(r.is_open for r in proxy.state.pool.replicas)
    text = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "after"}]).choices[0]
    assert text.message.content.startswith("[w1] ")
    listing = _versions(proxy)
    failed = next(v for v in listing["data"] if v["name"] == "v2")
    assert failed["status"] == "failed" and "reload" in failed["error"] and listing["serving"] == "v1"
    with factory() as s:
        assert s.get(t.Step, step.id).trained_version_id is None  # released for retraining
        assert s.scalars(select(t.VersionLineage.step_id).where(t.VersionLineage.version_id == "cand-2")).all() == [step.id]
    # A failed version is not swapped to again under the same name.
    assert _swap(proxy, "/ckpt/w2", name="v2").status_code == 409

    # Rollback of the serving v1: base serves again on both replicas.
    upstreams[1].fail_reload = False
    v1 = next(v for v in listing["data"] if v["name"] == "v1")
    r = httpx.post(proxy.url + f"/atdp/v1/versions/{v1['id']}/rollback", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "base" and r.json()["status"] == "serving"
    assert r.json()["rolled_back"] == {"id": v1["id"], "name": "v1", "status": "rolled_back"}
    assert [u.weights for u in upstreams] == ["fake", "fake"]  # base's checkpoint: /models/fake
    assert [r.version for r in proxy.state.pool.replicas] == ["base", "base"]
    status = {v["name"]: v["status"] for v in _versions(proxy)["data"]}
    assert status == {"base": "serving", "v1": "rolled_back", "v2": "failed"}
    # Only the serving version can be rolled back; base has nothing before it.
    assert httpx.post(proxy.url + f"/atdp/v1/versions/{v1['id']}/rollback", headers=ADMIN).status_code == 409
    assert httpx.post(proxy.url + "/atdp/v1/versions/base/rollback", headers=ADMIN).status_code == 409


def test_restart_reads_serving_version_from_the_database(start_proxy, fakes, own_db):
    upstreams, _ = fakes
    url, _factory = own_db
    proxy = _start(start_proxy, upstreams, url)
    assert _swap(proxy, "/ckpt/w3", name="v3").status_code == 200
    proxy.server.stop()
    again = _start(start_proxy, upstreams, url)
    assert [r.version for r in again.state.pool.replicas] == ["v3", "v3"]
    assert _versions(again)["serving"] == "v3"


# --- the real engine ----------------------------------------------------------------------------------


@pytest.mark.vllm
def test_real_vllm_swap_exact_versions_under_load(start_proxy, vllm_server, tiny_model_dir_b, own_db):
    from tests.vllm_fixtures import swap_weights

    url, factory = own_db
    proxy = start_proxy([vllm_server.base_url], database_url=url)
    assert proxy.versions.ready.wait(60)
    prompts = ["hello there", "what is 12 + 7?", "the quick brown fox", "say a number"]
    try:
        stop, results, errors = threading.Event(), [], []
        workers = [threading.Thread(target=_traffic, args=(proxy, stop, results, errors),
                                    kwargs={"model": vllm_server.model, "prompts": prompts, "index": k,
                                            "max_tokens": 12})
                   for k in range(4)]
        for w in workers:
            w.start()
        time.sleep(1.5)
        r = _swap(proxy, str(tiny_model_dir_b), name="seed1")
        time.sleep(1.5)
        stop.set()
        for w in workers:
            w.join(120)
        assert r.status_code == 200, r.text
        assert not errors, errors[:3]

        base_id = next(v["id"] for v in _versions(proxy)["data"] if v["name"] == "seed1")
        back = httpx.post(proxy.url + f"/atdp/v1/versions/{base_id}/rollback", headers=ADMIN, timeout=120)
        assert back.status_code == 200 and back.json()["name"] == "base", back.text
    finally:
        # The server is shared by the test session: whatever happened, it serves seed 0 again.
        info = httpx.get(vllm_server.base_url + "/weight_info", timeout=10).json()
        if info.get("weight_version") != "base":
            swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")

    # Expected greedy tokens for each prompt under each weight set, asked of the engine directly.
    def greedy(prompt: str) -> list[int]:
        body = {"model": vllm_server.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": 12, "return_token_ids": True}
        return httpx.post(vllm_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]

    expected = {"base": {p: greedy(p) for p in prompts}}
    swap_weights(vllm_server.base_url, tiny_model_dir_b, "seed1")
    try:
        expected["seed1"] = {p: greedy(p) for p in prompts}
    finally:
        swap_weights(vllm_server.base_url, vllm_server.model_dir, "base")
    for p in prompts:
        assert expected["base"][p] != expected["seed1"][p]  # the two weight sets are told apart

    prompt_of = {}
    with httpx.Client(base_url=vllm_server.base_url, timeout=30) as h:
        for p in prompts:
            ids = h.post("/tokenize", json={"model": vllm_server.model,
                                            "messages": [{"role": "user", "content": p}]}).json()["tokens"]
            prompt_of[tuple(ids)] = p
    steps = proxy.steps(factory)
    with factory() as s:
        full = rebuild_prompt_ids({st.id: st for st in steps}, fetch=lambda i: s.get(t.Step, i))
    counts = {"base": 0, "seed1": 0}
    for st in steps:
        versions = set(unrle(st.output_versions))
        assert versions == {st.model_version}
        p = prompt_of[tuple(full[st.id])]
        assert st.output_token_ids == expected[st.model_version][p], (p, st.model_version)
        counts[st.model_version] += 1
    assert len(steps) == len(results) and counts["base"] > 0 and counts["seed1"] > 0
    print(f"steps by version: {counts}; swap {r.json()['swap']['seconds']:.3f} s")
