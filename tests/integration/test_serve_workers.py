"""`atdp serve --workers 3`: three proxy processes on one port share PostgreSQL only (issue 17, item 1).

The real command, in a subprocess, in front of a scripted upstream. A client that sends no ids
(Hermes-shaped chat completions) opens a new connection for every call, so the kernel spreads its
turns over the workers (the test learns which worker served a call from `/healthz` on the same
connection). Each conversation is still one session with its parent chain. The writers hold steps
for 2 s, so SIGTERM reaches the workers with steps not yet stored: a clean shutdown stores them all.

And a swap under load through the three: calls on new connections (so on every worker) while one
worker, the one the version's POST reached, drives the swap of two scripted replicas. No call
fails, every step is stamped with the version of the weights that wrote it, and every worker
stamps the new version afterwards.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
from sqlalchemy import func, select

from proxy.store import tables as t
from proxy.store.tokens import unrle
from tests.fake_vllm import FakeVLLM, ServerThread, free_port

ROOT = Path(__file__).resolve().parents[2]
HERMES = {"User-Agent": "HermesAgent/0.4 (python)"}
WORKERS = 3


def start_workers(tmp_path: Path, upstream: str, url: str, tenant: str, port: int,
                  **extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATDP_HOME": str(tmp_path / "home"), "ATDP_OPEN_MODE": "1",
           "ATDP_DEFAULT_TENANT": tenant, "ATDP_UPSTREAM_URL": upstream, "ATDP_DATABASE_URL": url,
           "ATDP_FLUSH_INTERVAL_S": "2.0", "ATDP_SHARED_LINKS": "0", **extra}  # --workers turns the links on anyway
    return subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--workers", str(WORKERS), "--port",
                             str(port), "--log-level", "warning"], cwd=ROOT, env=env, start_new_session=True)


def wait_all_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    """Every worker answered `/healthz` with its database and writer up (a new connection each time)."""
    ready: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(ready) < WORKERS:
        assert proc.poll() is None, "atdp serve --workers exited"
        assert time.monotonic() < deadline, f"workers ready: {sorted(ready)}"
        try:
            h = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
            if h["database"] and h["status"] == "ok" and h["swap_listener"]:
                ready.add(h["worker"])
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert ready == set(range(1, WORKERS + 1))


def call(port: int, messages: list[dict], stream: bool) -> tuple[str, str, int]:
    """One turn on a new connection: (text, step id, the worker that served it)."""
    with httpx.Client(timeout=60) as http:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="open-mode", max_retries=0,
                               default_headers=HERMES, http_client=http)
        if stream:
            with client.chat.completions.with_streaming_response.create(model="fake", messages=messages,
                                                                        stream=True) as raw:
                text = "".join((c.choices[0].delta.content or "") for c in raw.parse() if c.choices)
                sid = raw.headers["x-atdp-step-id"]
        else:
            raw = client.chat.completions.with_raw_response.create(model="fake", messages=messages)
            text, sid = raw.parse().choices[0].message.content, raw.headers["x-atdp-step-id"]
        worker = http.get(f"http://127.0.0.1:{port}/healthz").json()["worker"]  # same connection, same worker
    return text, sid, worker


def test_three_workers_keep_one_session_per_conversation_and_drain_on_sigterm(tmp_path, own_db, fake_upstream):
    url, factory = own_db
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    port = free_port()
    proc = start_workers(tmp_path, fake_upstream.url, url, tenant, port)
    try:
        wait_all_ready(port, proc)
        convs = {name: [{"role": "system", "content": f"You are agent {name}."}] for name in ("a", "b", "c")}
        step_ids: dict[str, list[str]] = {name: [] for name in convs}
        served_by: dict[str, list[int]] = {name: [] for name in convs}
        for turn in range(5):
            for name, messages in convs.items():
                messages.append({"role": "user", "content": f"{name} turn {turn}"})
                text, sid, worker = call(port, messages, stream=bool(turn % 2))
                messages.append({"role": "assistant", "content": text})
                step_ids[name].append(sid)
                served_by[name].append(worker)
        workers = [w for ws in served_by.values() for w in ws]
        assert len(set(workers)) >= 2, served_by  # the kernel spread the calls
        assert any(len(set(ws)) > 1 for ws in served_by.values()), served_by  # a conversation crossed workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(180) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with factory() as s:
        rows = s.execute(select(t.Session.external_id, t.Step).join(t.Step, t.Step.session_id == t.Session.id)
                         .where(t.Session.tenant_id == tenant).order_by(t.Step.started_at)).all()
        stored = s.scalar(select(func.count()).select_from(t.Step).where(t.Step.tenant_id == tenant))
    assert stored == 15  # every step stored by the shutdown (held for 2 s when SIGTERM came)
    sessions: dict[str, list[t.Step]] = {}
    for ext, step in rows:
        sessions.setdefault(ext, []).append(step)
    assert len(sessions) == 3
    by_first = {steps[0].id: steps for steps in sessions.values()}
    for ids in step_ids.values():
        steps = by_first[ids[0]]
        assert [s.id for s in steps] == ids
        assert [s.parent_step_id for s in steps] == [None, *ids[:-1]]
    assert not any((tmp_path / "home" / "spool").rglob("*.jsonl"))


def test_a_forget_through_one_worker_purges_every_workers_dead_letters(tmp_path, own_db, fake_upstream):
    """Each worker sets refused steps aside in its own folder (spool/worker-K/rejected); a forget
    reaches one worker, which announces it: every worker purges its own."""
    url, factory = own_db
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    port = free_port()
    proc = start_workers(tmp_path, fake_upstream.url, url, tenant, port, ATDP_FLUSH_INTERVAL_S="0.05")
    try:
        wait_all_ready(port, proc)
        for name in ("gone", "kept"):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"x-atdp-session-id": name},
                           json={"model": "fake", "messages": [{"role": "user", "content": f"about {name}"}]},
                           timeout=60)
            assert r.status_code == 200, r.text
        spool = tmp_path / "home" / "spool"
        for k in range(1, WORKERS + 1):  # what a database refusal leaves, in every worker's folder
            folder = spool / f"worker-{k}" / "rejected"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{time.time_ns():020d}-test.jsonl").write_text("".join(
                json.dumps({"reason": "test", "record": {"kind": "step", "id": str(uuid.uuid4()), "session": {
                    "tenant_id": tenant, "external_id": name}}}) + "\n" for name in ("gone", "kept")))

        def letters() -> list[str]:
            return sorted(json.loads(line)["record"]["session"]["external_id"]
                          for f in spool.glob("worker-*/rejected/*.jsonl") for line in f.read_text().splitlines())

        assert letters() == ["gone"] * WORKERS + ["kept"] * WORKERS
        deadline = time.monotonic() + 30
        while not _stored(factory, tenant, "gone"):
            assert time.monotonic() < deadline, "the session was never stored"
            time.sleep(0.1)
        r = httpx.delete(f"http://127.0.0.1:{port}/atdp/v1/sessions/gone", timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["steps"] == 1 and r.json()["dead_letters"] == 1  # the answering worker's own
        while letters() != ["kept"] * WORKERS:
            assert time.monotonic() < deadline, letters()
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stored(factory, tenant: str, session: str) -> bool:
    with factory() as s:
        return bool(s.scalar(select(func.count()).select_from(t.Step).join(t.Session, t.Session.id == t.Step.session_id)
                             .where(t.Session.tenant_id == tenant, t.Session.external_id == session)))


def _traffic(port: int, stop: threading.Event, results: list[str], errors: list[str], offset: int) -> None:
    for i in itertools.count(offset, 6):
        if stop.is_set():
            return
        try:  # a new connection per call: the kernel spreads the calls over every worker
            with httpx.Client(timeout=60) as http:
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="open-mode",
                                       max_retries=0, http_client=http)
                messages = [{"role": "user", "content": f"q{i}"}]
                if i % 2:
                    chunks = client.chat.completions.create(model="fake", messages=messages, stream=True)
                    results.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
                else:
                    answer = client.chat.completions.create(model="fake", messages=messages)
                    results.append(answer.choices[0].message.content)
        except Exception as e:  # any failure is a test failure: collected and asserted on
            errors.append(f"{type(e).__name__}: {e}")


def test_a_swap_under_load_through_three_workers(tmp_path, own_db):
    url, factory = own_db
    fakes, servers = [FakeVLLM(), FakeVLLM()], []
    for fake in fakes:
        fake.chunk_delay = 0.002  # a model generating: calls are in flight when a gate closes
        servers.append(ServerThread(fake).start())
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    port = free_port()
    proc = start_workers(tmp_path, ",".join(s.url for s in servers), url, tenant, port,
                         ATDP_ADMIN_KEY="admin-test-key", ATDP_CHECKPOINT_ROOTS="/", ATDP_FLUSH_INTERVAL_S="0.05")
    stop, results, errors = threading.Event(), [], []
    threads = [threading.Thread(target=_traffic, args=(port, stop, results, errors, k)) for k in range(6)]
    try:
        wait_all_ready(port, proc)
        for th in threads:
            th.start()
        deadline = time.monotonic() + 60
        while len(results) < 18:  # traffic on the old version first
            assert time.monotonic() < deadline and not errors, errors[:5]
            time.sleep(0.05)
        r = httpx.post(f"http://127.0.0.1:{port}/atdp/v1/versions", timeout=180,
                       headers={"authorization": "Bearer admin-test-key"},
                       json={"checkpoint": "/ckpt/w1", "name": "v1", "promote": "now"})
        n = len(results)
        while len(results) < n + 18:  # and on the new one
            assert time.monotonic() < deadline + 120 and not errors, errors[:5]
            time.sleep(0.05)
        stop.set()
        for th in threads:
            th.join(60)
        assert r.status_code == 200 and r.json()["swap"]["ok"], r.text
        assert not errors, errors[:5]
        assert all(f.weights == "w1" for f in fakes)
        stamped: dict[int, list[str]] = {}
        while len(stamped) < WORKERS:  # every worker stamps the new version, not only the driver
            h = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
            stamped[h["worker"]] = [rep["version"] for rep in h["replicas"]]
        assert stamped == {k: ["v1", "v1"] for k in range(1, WORKERS + 1)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(180) == 0
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for s in servers:
            s.stop()
    with factory() as s:
        steps = list(s.query(t.Step).filter(t.Step.tenant_id == tenant))
    weights_of = {"base": "w0", "v1": "w1"}
    assert len(steps) == len(results) >= 36
    wrong = [(st.model_version, bytes(st.output_token_ids).decode()[:6]) for st in steps
             if not bytes(st.output_token_ids).decode().startswith(f"[{weights_of[st.model_version]}] ")
             or set(unrle(st.output_versions)) != {st.model_version}]
    assert wrong == []
    assert {st.model_version for st in steps} == {"base", "v1"}
