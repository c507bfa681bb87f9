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
        if scope["type"] == "http" and scope["path"] in ("/sleep", "/resume"):
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
    assert events == [("a", "/sleep"), ("a", "/resume"), ("b", "/sleep"), ("b", "/resume")]
    assert all(u.weights == "w1" and u.version == "v1" for u in upstreams)
    # each engine's prefix cache dropped once, inside its pause (no old-weight keys reach the new weights)
    assert [u.prefix_resets for u in upstreams] == [1, 1]

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
        t.get_step(s, step.id).trained_version_id = "cand-2"

    upstreams[1].fail_reload = True  # the second replica cannot load it
    r = _swap(proxy, "/ckpt/w2", name="v2")
    assert r.status_code == 502
    body = r.json()
    assert body["status"] == "failed" and "reload_weights" in body["swap"]["error"]
    # Old version everywhere: replica a was swapped then restored; b restored after the failure.
    # (b's engine was tagged v2 beside its failed reload, and tagged v1 again by the restore)
    assert [u.weights for u in upstreams] == ["w1", "w1"] and [u.version for u in upstreams] == ["v1", "v1"]
    assert [r.version for r in proxy.state.pool.replicas] == ["v1", "v1"]
    assert all(r.is_open for r in proxy.state.pool.replicas)
    text = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "after"}]).choices[0]
    assert text.message.content.startswith("[w1] ")
    listing = _versions(proxy)
    failed = next(v for v in listing["data"] if v["name"] == "v2")
    assert failed["status"] == "failed" and "reload" in failed["error"] and listing["serving"] == "v1"
    with factory() as s:
        assert t.get_step(s, step.id).trained_version_id is None  # released for retraining
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
        full = rebuild_prompt_ids({st.id: st for st in steps}, fetch=lambda i, sid: t.get_step(s, i, sid))
    counts = {"base": 0, "seed1": 0}
    for st in steps:
        versions = set(unrle(st.output_versions))
        assert versions == {st.model_version}
        p = prompt_of[tuple(full[st.id])]
        assert st.output_token_ids == expected[st.model_version][p], (p, st.model_version)
        counts[st.model_version] += 1
    assert len(steps) == len(results) and counts["base"] > 0 and counts["seed1"] > 0
    print(f"steps by version: {counts}; swap {r.json()['swap']['seconds']:.3f} s")


def test_checkpoints_only_under_the_configured_roots(start_proxy, fakes, own_db, tmp_path):
    """A new checkpoint outside ATDP_CHECKPOINT_ROOTS (default: ATDP_HOME/checkpoints) is a 400,
    `..` and symbolic links included; one inside is registered and swapped in (#13)."""
    upstreams, _ = fakes
    url, _ = own_db
    home = tmp_path / "home"
    proxy = start_proxy([u.url for u in upstreams], database_url=url, home=home, checkpoint_roots=[])
    assert proxy.versions.ready.wait(30)
    inside = home / "checkpoints" / "v-ok"
    inside.mkdir(parents=True)
    (home / "checkpoints" / "escape").symlink_to(tmp_path)
    for bad in ("/etc", str(tmp_path / "elsewhere"), str(home / "checkpoints" / ".." / "secret"),
                str(home / "checkpoints" / "escape" / "x"), "relative/path"):
        r = _swap(proxy, bad, name="nope")
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "checkpoint"
    assert [v["name"] for v in _versions(proxy)["data"]] == ["base"]  # nothing registered
    r = _swap(proxy, str(inside), name="ok")
    assert r.status_code in (200, 202), r.text
    assert _versions(proxy)["serving"] == "ok"
    # Re-posting a known version (here: back to the engine's own base model) is not a new path.
    assert _swap(proxy, "/models/fake", name="base").status_code in (200, 202)


@pytest.mark.parametrize("slow_s,drain_s,swapped", [(3.0, 6.0, True), (4.0, 2.0, False)])
def test_a_long_call_never_fails_the_calls_held_behind_a_swap(start_proxy, fake_upstream, own_db, slow_s, drain_s,
                                                             swapped):
    """A call longer than the hold timeout delays a swap (or makes it give up at its drain timeout);
    the calls waiting at the gate meanwhile are answered, by the new weights or the old (#13)."""
    url, _ = own_db
    proxy = start_proxy([fake_upstream.url], database_url=url, swap_hold_timeout_s=1.0, swap_drain_timeout_s=drain_s)
    assert proxy.versions.ready.wait(30)
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=60)
    out: dict[str, object] = {}

    def call(key: str, text: str) -> None:
        try:
            r = client.chat.completions.with_raw_response.create(
                model="fake", messages=[{"role": "user", "content": text}])
            out[key] = r.parse().choices[0].message.content
        except Exception as e:  # asserted on below
            out[key] = e

    def swap() -> None:
        out["swap"] = _swap(proxy, "/ckpt/after-long-call", name="after-long-call")

    long_call = threading.Thread(target=call, args=("long", f"#slow {slow_s}"))
    long_call.start()
    time.sleep(0.5)
    swapper = threading.Thread(target=swap)
    swapper.start()
    # Held means sent once the gate is closed (the POST takes 0.2-0.4 s to get there on a loaded machine).
    deadline = time.monotonic() + 10
    while proxy.state.pool.replicas[0].is_open:
        assert time.monotonic() < deadline, "the swap never closed the gate"
        time.sleep(0.01)
    held = [threading.Thread(target=call, args=(f"held{i}", f"held {i}")) for i in range(3)]
    for th in held:
        th.start()
    for th in (long_call, swapper, *held):
        th.join(60)
    errors = {k: v for k, v in out.items() if isinstance(v, Exception)}
    assert not errors, errors
    assert _versions(proxy)["serving"] == ("after-long-call" if swapped else "base"), out["swap"].text
    weights = "after-long-call" if swapped else "w0"  # the scripted upstream names its loaded weights
    for i in range(3):
        assert f"held {i}" in out[f"held{i}"] and weights in out[f"held{i}"], out[f"held{i}"]


def test_a_versions_write_key_registers_versions_and_nothing_else(start_proxy, fakes, own_db, tmp_path):
    """`atdp keys create --scope versions:write` (the trainer's key): POST /atdp/v1/versions works;
    every other control route, the operator override and model traffic answer 403 (#13)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    upstreams, _ = fakes
    url, _ = own_db
    root = Path(__file__).resolve().parents[2]
    made = subprocess.run([sys.executable, "-m", "proxy.cli", "keys", "create", "--tenant", "trainer",
                           "--scope", "versions:write"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ATDP_DATABASE_URL": url, "ATDP_HOME": str(tmp_path / "cli-home")})
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("atdp-") and "scoped: versions:write" in made.stderr
    bad = subprocess.run([sys.executable, "-m", "proxy.cli", "keys", "create", "--tenant", "trainer", "--admin",
                          "--scope", "versions:write"], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ATDP_DATABASE_URL": url, "ATDP_HOME": str(tmp_path / "cli-home")})
    assert bad.returncode == 2 and "cannot be an admin key" in bad.stderr

    proxy = start_proxy([u.url for u in upstreams], database_url=url, open_mode=False)
    assert proxy.versions.ready.wait(30)
    auth = {"authorization": f"Bearer {key}"}
    r = httpx.post(proxy.url + "/atdp/v1/versions", json={"checkpoint": "/ckpt/by-trainer", "name": "by-trainer",
                                                         "wait": True}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "serving", r.text
    r = httpx.post(proxy.url + "/atdp/v1/versions", json={"checkpoint": "/ckpt/forced", "promote": "now"},
                   headers=auth, timeout=10)
    assert r.status_code == 403, r.text
    refused = [
        ("GET", "/atdp/v1/versions", None), ("GET", "/atdp/v1/versions/by-trainer", None),
        ("POST", "/atdp/v1/versions/by-trainer/rollback", {}), ("GET", "/atdp/v1/audit", None),
        ("GET", "/atdp/v1/sessions", None), ("DELETE", "/atdp/v1/sessions/x", None),
        ("GET", "/atdp/v1/tenants/trainer/policy", None), ("PUT", "/atdp/v1/tenants/trainer/policy", {"x": 1}),
        ("DELETE", "/atdp/v1/tenants/trainer", None), ("GET", "/atdp/v1/diagnosis", None),
        ("POST", "/atdp/v1/sessions/x/feedback", {"reward": 1}),
        ("POST", "/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/messages", {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ]
    for method, path, body in refused:
        r = httpx.request(method, proxy.url + path, json=body, headers=auth, timeout=10)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
    assert _versions(proxy)["serving"] == "by-trainer"  # the admin key still sees everything
