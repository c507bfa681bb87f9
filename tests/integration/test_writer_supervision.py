"""Nothing lost when the writer is in trouble: its child process killed (restarted, batches re-sent),
SIGTERM to the whole process group of `atdp serve` (drained first), a spool that cannot be written
(503 to new calls, the answered steps held), stored responses through a long database outage, and
feedback posted before the writer has written the step it is about.

Every count below is answered calls against rows (or spooled records) of a real PostgreSQL.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from sqlalchemy import select

from proxy.store import db
from proxy.store import tables as t
from tests.fake_vllm import free_port

ROOT = Path(__file__).resolve().parents[2]
BAD_DB = "postgresql://postgres@127.0.0.1:1/nowhere"


def _chat(base: str, content: str, session: str | None = None, timeout: float = 30) -> httpx.Response:
    headers = {"x-atdp-session-id": session} if session else {}
    return httpx.post(base + "/v1/chat/completions", headers=headers, timeout=timeout,
                      json={"model": "fake", "messages": [{"role": "user", "content": content}]})


def _step_ids(factory, tenant: str) -> set[str]:
    with factory() as s:
        return set(s.scalars(select(t.Step.id).where(t.Step.tenant_id == tenant)))


def _spooled(folder: Path) -> list[dict]:
    return [orjson.loads(line) for p in sorted(folder.glob("*.jsonl")) for line in p.read_bytes().splitlines()]


def test_writer_killed_mid_traffic_restarts_and_loses_nothing(start_proxy, fake_upstream, factory):
    proxy = start_proxy([fake_upstream.url], writer_mode="process")
    rec = proxy.state.recorder
    n, answered, health = 200, [], []
    first_pid = rec.pid

    def kill_when_holding() -> None:
        while len(answered) < 40:
            time.sleep(0.005)
        deadline = time.monotonic() + 10
        while rec.pending == 0 and time.monotonic() < deadline:  # answered steps not yet durable
            time.sleep(0.001)
        health.append(("held at kill", rec.pending))
        os.kill(first_pid, signal.SIGKILL)
        for _ in range(500):  # while it is down, /healthz says so
            h = httpx.get(proxy.url + "/healthz", timeout=10)
            health.append((h.status_code, h.json()))
            if h.status_code == 503:
                return
            time.sleep(0.005)

    def one(i: int) -> None:
        r = _chat(proxy.url, f"load {i} {uuid.uuid4().hex}")
        assert r.status_code == 200, r.text  # a dead writer never fails a model call
        answered.append(r.headers["x-atdp-step-id"])

    killer = threading.Thread(target=kill_when_holding)
    killer.start()
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(one, range(n)))
    killer.join(30)
    assert health[0][0] == "held at kill" and health[0][1] > 0, health[0]
    down = [body for code, body in health[1:] if code == 503]
    assert down, health[-3:]
    assert down[0]["status"] == "unavailable" and not down[0]["writer"]["alive"]
    assert any("writer is down" in p for p in down[0]["problems"])
    proxy.flush(90)
    assert rec.restarts >= 1 and rec.pid != first_pid
    ok = httpx.get(proxy.url + "/healthz").json()
    assert ok["status"] == "ok" and ok["writer"]["alive"] and ok["writer"]["restarts"] == rec.restarts
    metrics = httpx.get(proxy.url + "/metrics").text
    restarts = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("atdp_writer_restarts_total"))
    assert restarts >= 1 and "atdp_writer_up 1.0" in metrics
    stored = _step_ids(factory, proxy.tenant)
    print(f"kill -9 writer: {len(answered)} answered, {len(stored)} stored, {health[0][1]} held at the kill, "
          f"{rec.restarts} restart(s)")  # the figures `pytest -s` shows
    assert len(answered) == n and stored == set(answered)  # 0 lost, none duplicated (ids are keys)


def test_sigterm_to_the_process_group_drains_every_answered_step(fake_upstream, new_database, tmp_path):
    url = new_database("atdp_sigterm")
    db.upgrade(url)
    port, tenant = free_port(), f"t-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATDP_")}
    # A 2 s batching window keeps answered steps held in the proxy when the signal lands.
    env.update(ATDP_DATABASE_URL=url, ATDP_UPSTREAM_URL=fake_upstream.url, ATDP_HOME=str(tmp_path / "home"),
               ATDP_OPEN_MODE="1", ATDP_DEFAULT_TENANT=tenant, ATDP_PORT=str(port), ATDP_FLUSH_INTERVAL_S="2.0")
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/healthz", timeout=2).json().get("database"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        answered: list[str] = []
        stop = threading.Event()

        def client(k: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    r = _chat(base, f"client {k} call {i}", session=f"sig-{k}", timeout=60)
                except httpx.HTTPError:
                    return  # the proxy stopped listening
                if r.status_code == 200:
                    answered.append(r.headers["x-atdp-step-id"])
                i += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        while len(answered) < 150:
            assert proc.poll() is None
            time.sleep(0.01)
        # Signal while answered steps wait in the batching window (held by the proxy, or in the child).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            writer = httpx.get(base + "/healthz", timeout=10).json()["writer"]
            held = writer["held"]
            if held >= 8 and writer["oldest_held_s"] < 1.5:
                break
        os.killpg(proc.pid, signal.SIGTERM)  # what systemd does: the whole group, writer child included
        # uvicorn shuts down in order, then re-raises the signal it caught: -SIGTERM is a clean exit.
        assert proc.wait(120) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in (tmp_path / "serve.log").read_text()
        stop.set()
        for th in threads:
            th.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert held >= 8  # steps were still waiting for the writer when the signal came
    engine = db.make_engine(url)
    try:
        stored = _step_ids(db.session_factory(engine), tenant)
    finally:
        engine.dispose()
    print(f"SIGTERM to the group: {len(answered)} answered, {len(stored)} stored, {held} held at the signal")
    assert len(answered) >= 150 and stored == set(answered)


def test_spool_that_cannot_be_written_answers_503_and_loses_nothing(start_proxy, fake_upstream):
    """The database is away and the spool's disk is "full" (a file-size limit on the writer child:
    the real write fails with EFBIG): new calls get 503 in their door's format, answered steps are
    held, and once the disk has room again everything answered is spooled."""
    proxy = start_proxy([fake_upstream.url], database_url=BAD_DB, wait_db=False, writer_mode="process")
    rec = proxy.state.recorder
    answered = []
    r = _chat(proxy.url, "before")
    assert r.status_code == 200
    answered.append(r.headers["x-atdp-step-id"])
    proxy.flush(60)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.prlimit(rec.pid, resource.RLIMIT_FSIZE, (64, hard))
    refused = None
    try:
        for i in range(60):
            r = _chat(proxy.url, f"during {i}")
            if r.status_code != 200:
                refused = r
                break
            answered.append(r.headers["x-atdp-step-id"])
            time.sleep(0.1)
        assert refused is not None and refused.status_code == 503, "the spool never failed: test proved nothing"
        assert "spool" in refused.json()["error"]["message"]  # OpenAI's error object
        m = httpx.post(proxy.url + "/v1/messages", json={"model": "fake", "max_tokens": 8,
                                                          "messages": [{"role": "user", "content": "x"}]})
        assert m.status_code == 503 and m.json()["type"] == "error"  # Anthropic's
        assert m.json()["error"]["type"] == "overloaded_error"
        h = httpx.get(proxy.url + "/healthz")
        assert h.status_code == 503 and any("spool" in p for p in h.json()["problems"])
        assert rec.pending >= 1  # the answered step is held, not dropped
    finally:
        resource.prlimit(rec.pid, resource.RLIMIT_FSIZE, (hard, hard))
    deadline = time.monotonic() + 30
    while (rec.refusing() or rec.pending) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rec.refusing() is None and rec.pending == 0
    r = _chat(proxy.url, "after")
    assert r.status_code == 200 and httpx.get(proxy.url + "/healthz").status_code == 200
    answered.append(r.headers["x-atdp-step-id"])
    proxy.flush(60)
    records = _spooled(proxy.state.settings.spool_dir)  # every line parses: no torn line was left behind
    assert sorted(x["id"] for x in records) == sorted(answered)


def test_stored_responses_survive_a_long_database_outage(start_proxy, fake_upstream, factory, tmp_path):
    """Stored responses take the steps' durable path: spooled while the database is away (for any
    length of time), written when it is back; `previous_response_id` then continues from them."""
    home = tmp_path / "home"
    down = start_proxy([fake_upstream.url], database_url=BAD_DB, home=home, wait_db=False)
    client = openai.OpenAI(base_url=down.v1, api_key="x", max_retries=0)
    r1 = client.responses.create(model="fake", input="remember the word plum")
    assert down.response_store.flush(30)
    spooled = _spooled(down.state.settings.spool_dir)
    kept = [x for x in spooled if x.get("kind") == "stored_response"]
    assert [x["id"] for x in kept] == [r1.id] and b"plum" not in orjson.dumps(kept)  # sealed on disk too
    down.server.stop()
    up = start_proxy([fake_upstream.url], home=home, tenant=down.tenant)
    deadline = time.monotonic() + 30
    while up.state.recorder.spool.pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    with factory() as s:
        assert s.scalar(select(t.StoredResponse.id).where(t.StoredResponse.id == r1.id)) == r1.id
    again = openai.OpenAI(base_url=up.v1, api_key="x", max_retries=0)
    r2 = again.responses.create(model="fake", previous_response_id=r1.id, input="#say noted")
    assert r2.output_text == "[w0] noted"
    assert fake_upstream.requests[-1]["messages"][0] == {"role": "user", "content": "remember the word plum"}


@pytest.mark.parametrize("target", ["step", "session"])
def test_feedback_right_after_the_response_waits_for_the_write(start_proxy, fake_upstream, factory, target):
    # A 3 s batching window: the writer has not written the step when the feedback arrives.
    proxy = start_proxy([fake_upstream.url], writer_mode="process", flush_interval_s=3.0)
    session = f"fb-{target}-{uuid.uuid4().hex[:8]}"
    r = _chat(proxy.url, "hello", session=session)
    assert r.status_code == 200
    step_id = r.headers["x-atdp-step-id"]
    assert proxy.state.recorder.inflight.holds(session, step_id), "already written: the case is not exercised"
    body = {"reward": 1.0, **({"step_id": step_id} if target == "step" else {})}
    fb = httpx.post(proxy.url + f"/atdp/v1/sessions/{session}/feedback", json=body, timeout=30)
    assert fb.status_code == 200, fb.text
    assert fb.json()["step_id"] == (step_id if target == "step" else None)
    with factory() as s:
        row = s.scalar(select(t.Feedback).join(t.Session, t.Session.id == t.Feedback.session_id)
                       .where(t.Session.external_id == session))
    assert row is not None and row.reward == 1.0
    # A session nobody answered is still a 404.
    missing = httpx.post(proxy.url + "/atdp/v1/sessions/never-answered/feedback", json={"reward": 1.0})
    assert missing.status_code == 404


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_lagging_writer_is_reported(start_proxy, fake_upstream, mode):
    # A 4 s batching window against a 1 s lag limit: the answered step waits too long to be written.
    proxy = start_proxy([fake_upstream.url], writer_mode=mode, flush_interval_s=4.0, writer_lag_s=1.0)
    assert _chat(proxy.url, "slow to write").status_code == 200
    deadline, seen = time.monotonic() + 4, None
    while time.monotonic() < deadline:
        h = httpx.get(proxy.url + "/healthz")
        if h.status_code == 503:
            seen = h.json()
            break
        time.sleep(0.05)
    assert seen is not None and any("lagging" in p for p in seen["problems"]), seen
    metrics = httpx.get(proxy.url + "/metrics").text
    oldest = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("atdp_writer_oldest_held_seconds"))
    assert oldest > 1.0 and "atdp_healthy 0.0" in metrics  # the step is held until the window ends (4 s)
    proxy.flush(30)
    h = httpx.get(proxy.url + "/healthz")
    assert h.status_code == 200 and h.json()["writer"]["held"] == 0


def test_a_full_batch_goes_to_the_writer_at_once_and_a_partial_one_when_its_window_ends(start_proxy, fake_upstream):
    """The proxy wakes its sender thread for a batch's first item and when the batch is full, not
    for every call in between: four calls (a full batch) are written long before their 5 s window
    ends; a lone call waits for it."""
    proxy = start_proxy([fake_upstream.url], writer_mode="process", flush_interval_s=5.0, batch_size=4)
    for i in range(4):
        assert _chat(proxy.url, f"one of a full batch {i}").status_code == 200
    t0 = time.monotonic()
    assert proxy.state.recorder.flush(10)
    assert time.monotonic() - t0 < 2.5
    assert _chat(proxy.url, "a batch of one").status_code == 200
    t0 = time.monotonic()
    assert proxy.state.recorder.flush(20)
    assert 3.0 < time.monotonic() - t0 < 10


def _small_files() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death (ignored survives exec)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_thread_writer_holds_steps_while_the_spool_fails(fake_upstream, tmp_path):
    """The in-process writer (`ATDP_WRITER=thread`) under the same failure: `atdp serve` starts with a
    256-byte file-size limit, so its spool cannot take a record; the answered step is held, new
    calls get 503, and once the limit is lifted every answered step is spooled."""
    port, tenant = free_port(), f"t-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATDP_")}
    env.update(ATDP_DATABASE_URL=BAD_DB, ATDP_UPSTREAM_URL=fake_upstream.url, ATDP_HOME=str(tmp_path / "home"),
               ATDP_OPEN_MODE="1", ATDP_DEFAULT_TENANT=tenant, ATDP_PORT=str(port), ATDP_WRITER="thread")
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_small_files)
    base = f"http://127.0.0.1:{port}"
    answered: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        refused = None
        for i in range(60):
            r = _chat(base, f"call {i}")
            if r.status_code != 200:
                refused = r
                break
            answered.append(r.headers["x-atdp-step-id"])
            time.sleep(0.1)
        assert answered and refused is not None and refused.status_code == 503, "the spool never failed"
        assert "spool" in refused.json()["error"]["message"]
        h = httpx.get(base + "/healthz")
        assert h.status_code == 503 and h.json()["writer"]["held"] >= 1
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        deadline = time.monotonic() + 30
        while httpx.get(base + "/healthz").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(base + "/healthz").text
            time.sleep(0.2)
        r = _chat(base, "after")
        assert r.status_code == 200
        answered.append(r.headers["x-atdp-step-id"])
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    records = _spooled(tmp_path / "home" / "spool")
    assert sorted(x["id"] for x in records) == sorted(answered)


def test_writer_killed_under_real_engine_traffic(start_proxy, vllm_server, factory):
    """The same kill -9 against the real engine (tiny model, streamed and not): every answered step
    is stored once, with the engine's own token ids."""
    proxy = start_proxy([vllm_server.base_url], writer_mode="process")
    rec = proxy.state.recorder
    client = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=120)
    answered: list[str] = []
    first_pid = rec.pid

    def one(i: int) -> None:
        messages = [{"role": "user", "content": f"count to {i}"}]
        if i % 2:
            raw = client.chat.completions.with_raw_response.create(model=vllm_server.model, messages=messages,
                                                                    max_tokens=8, temperature=0)
        else:
            raw = client.chat.completions.with_raw_response.create(model=vllm_server.model, messages=messages,
                                                                    max_tokens=8, temperature=0, stream=True)
            list(raw.parse())
        answered.append(raw.headers["x-atdp-step-id"])
        if i == 12:
            os.kill(first_pid, signal.SIGKILL)  # mid-traffic: later calls are answered while it restarts

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(one, range(40)))
    proxy.flush(90)
    assert rec.restarts >= 1 and rec.pid != first_pid
    with factory() as s:
        steps = list(s.scalars(select(t.Step).where(t.Step.tenant_id == proxy.tenant)))
    assert sorted(st.id for st in steps) == sorted(answered)
    assert all(st.token_source == "engine" and 0 < len(st.output_token_ids) <= 8 for st in steps)
