"""docker/haproxy.cfg, run by a real haproxy in front of three proxies on one database.

Without a Docker engine the compose stack cannot start here, so the load balancer's own file is run
as it ships, with two lines changed: the frontend binds a free loopback port, and the
`server-template` that finds the `proxy` replicas through Docker's DNS becomes three `server` lines
(each inheriting the file's `default-server` settings). Each proxy has its own scripted engine, so
the engines' request counts say which proxy served a call.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.compose_files import HAPROXY_CFG
from tests.fake_vllm import FakeVLLM, ServerThread, free_port
from tests.integration.test_multiproxy import HERMES, sessions_of

HAPROXY = os.environ.get("ATDP_HAPROXY") or shutil.which("haproxy") or "/usr/sbin/haproxy"  # as scripts/system_packages.sh


def shipped_config_for(port: int, servers: list[str]) -> str:
    """docker/haproxy.cfg with the bind and the server template swapped for local addresses."""
    text = HAPROXY_CFG.read_text()
    bind = re.compile(r"^(\s*)bind :8700$", re.M)
    template = re.compile(r"^(\s*)server-template proxy \d+ proxy:8700$", re.M)
    assert len(bind.findall(text)) == 1 and len(template.findall(text)) == 1, "docker/haproxy.cfg changed shape"
    text = bind.sub(lambda m: f"{m.group(1)}bind 127.0.0.1:{port}", text)
    return template.sub(lambda m: "\n".join(f"{m.group(1)}server proxy{i} {s}" for i, s in enumerate(servers)), text)


@pytest.fixture
def balanced(start_proxy, tmp_path: Path):
    """start(third={...}): three proxies (shared continuation keys, one tenant), each on its own
    engine, behind haproxy; `third` are settings of the third proxy only."""
    if not Path(HAPROXY).exists():
        pytest.fail(f"{HAPROXY} not found: run scripts/system_packages.sh (apt-get install haproxy)")
    servers: list[ServerThread] = []
    balancers: list[subprocess.Popen] = []

    def start(third: dict | None = None) -> tuple[str, list, list[FakeVLLM]]:
        engines = []
        for _ in range(3):
            fake = FakeVLLM()
            servers.append(ServerThread(fake).start())
            fake.url = servers[-1].url
            engines.append(fake)
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        proxies = [start_proxy([e.url], tenant=tenant, shared_links=True, **extra)
                   for e, extra in zip(engines, ({}, {}, third or {}), strict=True)]
        port = free_port()
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(shipped_config_for(port, [p.url.removeprefix("http://") for p in proxies]))
        check = subprocess.run([HAPROXY, "-c", "-n", "4000", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        log = tmp_path / "haproxy.log"
        with log.open("w") as out:
            # `-n`: the file's maxconn (20,000) needs about 40,000 open files, above this host's
            # limit (a container's is higher); every other setting is the file's.
            balancers.append(subprocess.Popen([HAPROXY, "-db", "-n", "4000", "-f", str(cfg)], stdout=out,
                                              stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    return url, proxies, engines
            except httpx.HTTPError:
                pass
            assert balancers[-1].poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)

    yield start
    for lb in balancers:
        lb.terminate()
        lb.wait(10)
    for s in servers:
        s.stop()


def chat_calls(engines: list[FakeVLLM]) -> list[int]:
    return [sum(1 for r in e.requests if "messages" in r) for e in engines]


def test_haproxy_spreads_conversations_over_three_proxies_and_each_stays_one_session(balanced, factory):
    url, proxies, engines = balanced()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused-in-open-mode", max_retries=0, default_headers=HERMES)
    convs = {name: [{"role": "system", "content": f"You are agent {name}."}] for name in ("a", "b", "c", "d")}
    steps: dict[str, list[str]] = {name: [] for name in convs}
    for turn in range(6):
        for name, messages in convs.items():  # a client that sends no ids, its turns interleaved
            messages.append({"role": "user", "content": f"{name} turn {turn}"})
            if turn % 2:
                with client.chat.completions.with_streaming_response.create(
                        model="fake", messages=messages, stream=True) as raw:
                    text = "".join((c.choices[0].delta.content or "") for c in raw.parse() if c.choices)
                    sid = raw.headers["x-atdp-step-id"]
            else:
                raw = client.chat.completions.with_raw_response.create(model="fake", messages=messages)
                text, sid = raw.parse().choices[0].message.content, raw.headers["x-atdp-step-id"]
            assert text == f"[w0] echo: {name} turn {turn}"
            messages.append({"role": "assistant", "content": text})
            steps[name].append(sid)
    calls = chat_calls(engines)
    assert sum(calls) == 24 and min(calls) >= 6, calls  # round robin: every proxy served its share
    for p in proxies:
        p.flush()
    sessions = sessions_of(factory, proxies[0].tenant)
    assert len(sessions) == 4
    for stored in sessions.values():
        chain = [s.id for s in stored]
        assert chain in list(steps.values())
        assert [s.parent_step_id for s in stored] == [None, *chain[:-1]]


def test_haproxy_relays_a_stream_as_it_is_generated(balanced):
    url, _, engines = balanced()
    for e in engines:
        e.chunk_delay = 0.15  # a model generating: 4 bytes each 0.15 s, about 2.5 s for this answer
    arrivals: list[float] = []
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "model": "fake", "stream": True, "messages": [{"role": "user", "content": "a slow answer, please: " + "x" * 40}]}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - t0)
    assert len(arrivals) > 10
    # Not buffered: the first chunk reaches the client long before the answer ends.
    assert arrivals[1] < 1.0 and arrivals[-1] - arrivals[1] > 1.5, arrivals


def test_haproxy_sends_no_calls_to_a_proxy_whose_healthz_fails(balanced):
    # The third proxy holds its steps a minute and calls a step held 1 s a lag: its /healthz turns
    # 503 once it has answered a call.
    url, proxies, engines = balanced(third={"flush_interval_s": 60.0, "writer_lag_s": 1.0})
    lagging = proxies[2]
    deadline = time.monotonic() + 10
    while chat_calls(engines)[2] == 0:  # until the lagging proxy holds an answered step
        assert time.monotonic() < deadline
        r = httpx.post(url + "/v1/chat/completions", timeout=10,
                       json={"model": "fake", "messages": [{"role": "user", "content": "warm up"}]})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 5
    while httpx.get(lagging.url + "/healthz").status_code != 503:
        assert time.monotonic() < deadline, httpx.get(lagging.url + "/healthz").json()
        time.sleep(0.1)
    time.sleep(4.5)  # the file's checks: every 2 s, down after 2 failures
    before = chat_calls(engines)
    for i in range(30):
        r = httpx.post(url + "/v1/chat/completions", timeout=10,
                       json={"model": "fake", "messages": [{"role": "user", "content": f"call {i}"}]})
        assert r.status_code == 200, r.text
    after = chat_calls(engines)
    assert after[2] == before[2] and after[0] - before[0] == after[1] - before[1] == 15, (before, after)


def test_a_proxy_that_stops_costs_no_failed_calls(balanced):
    url, proxies, engines = balanced()
    for i in range(6):
        assert httpx.post(url + "/v1/chat/completions", timeout=10,
                          json={"model": "fake", "messages": [{"role": "user", "content": f"before {i}"}]}).status_code == 200
    proxies[0].server.stop()  # gone before haproxy's checks notice: calls still sent its way are retried
    statuses = []
    for i in range(30):
        r = httpx.post(url + "/v1/chat/completions", timeout=10,
                       json={"model": "fake", "messages": [{"role": "user", "content": f"after {i}"}]})
        statuses.append(r.status_code)
    assert statuses == [200] * 30, statuses
