"""Several proxies on one database share continuation links by themselves (issue 42, item 2).

No ATDP_SHARED_LINKS: each proxy holds an advisory lock while it runs and counts the other holders
(proxy.store.presence). Two proxies (apps in this process, or two `atdp serve` processes) link a no-id
conversation whose turns alternate between them as one session, including a conversation the first proxy began while it was alone (its recent keys are
published when it switches); a lone proxy publishes nothing and turns lone again once its peer is
gone; ATDP_SHARED_LINKS=1/0 still force the mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
from sqlalchemy import func, select

from proxy.config import Settings
from proxy.store import tables as t
from tests.fake_vllm import free_port
from tests.integration.test_multiproxy import sessions_of, stored_steps

ROOT = Path(__file__).resolve().parents[2]
HERMES = {"User-Agent": "HermesAgent/0.4 (python)"}  # sends no session id: linking is all it has


def chat(proxy, messages: list[dict]) -> tuple[str, str, str]:
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused-in-open-mode", max_retries=0, default_headers=HERMES)
    raw = client.chat.completions.with_raw_response.create(model="fake", messages=messages)
    return raw.parse().choices[0].message.content, raw.headers["x-atdp-session-id"], raw.headers["x-atdp-step-id"]


def serve(tmp_path: Path, name: str, upstream: str, url: str, tenant: str) -> tuple[subprocess.Popen[bytes], int]:
    """A plain `atdp serve` (its writer a child process), with no ATDP_SHARED_LINKS in its environment."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ATDP_SHARED_LINKS"}
    env.update({"PYTHONPATH": str(ROOT), "ATDP_HOME": str(tmp_path / name), "ATDP_OPEN_MODE": "1",
                "ATDP_DEFAULT_TENANT": tenant, "ATDP_UPSTREAM_URL": upstream, "ATDP_DATABASE_URL": url,
                "ATDP_FLUSH_INTERVAL_S": "2.0"})
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, env=env)
    return proc, port


def health(port: int, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> dict:
    """`/healthz` once the proxy has its database."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "atdp serve exited"
        assert time.monotonic() < deadline, "atdp serve never had its database"
        try:
            h = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
            if h["database"]:
                return h
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def published(factory, session: str) -> int:
    with factory() as s:
        return s.scalar(select(func.count()).select_from(t.ContinuationLink)
                        .where(t.ContinuationLink.session_id == session))


def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_setting_reads_auto_on_and_off(monkeypatch):
    monkeypatch.delenv("ATDP_SHARED_LINKS", raising=False)
    assert Settings().shared_links is None
    for value, want in (("auto", None), ("", None), ("1", True), ("true", True), ("0", False), ("off", False)):
        monkeypatch.setenv("ATDP_SHARED_LINKS", value)
        assert Settings().shared_links is want, value


def test_two_plain_proxies_keep_one_session_per_conversation(start_proxy, fake_upstream, factory):
    """The issue's case: turns 0.3 s apart alternating between two proxies started with no setting;
    the writers hold steps for 3 s, so every next turn reaches the other proxy before its parent is stored."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = start_proxy([fake_upstream.url], tenant=tenant, flush_interval_s=3.0)
    assert a.state.settings.shared_links is None
    assert a.state.links is not None and not a.state.links.shared and a.state.presence.peers == 0
    b = start_proxy([fake_upstream.url], tenant=tenant, flush_interval_s=3.0)
    # b counted a at its start and waited for a to switch before it reported ready.
    assert b.state.links.shared and b.state.presence.peers == 1
    assert a.state.links.shared
    proxies = [a, b]
    convs = {name: [{"role": "system", "content": f"You are agent {name}."}] for name in ("x", "y")}
    ids: dict[str, list[tuple[str, str]]] = {name: [] for name in convs}
    for turn in range(4):
        for k, (name, messages) in enumerate(convs.items()):
            messages.append({"role": "user", "content": f"{name} turn {turn}"})
            text, session, step = chat(proxies[(turn + k) % 2], messages)
            messages.append({"role": "assistant", "content": text})
            ids[name].append((session, step))
            time.sleep(0.3)
        if turn == 0:
            assert stored_steps(factory, tenant) == 0  # the race: nothing is in the store yet
    for name, pairs in ids.items():
        assert len({s for s, _ in pairs}) == 1, name
    a.flush()
    b.flush()
    sessions = sessions_of(factory, tenant)
    assert len(sessions) == 2
    for pairs in ids.values():
        steps = sessions[pairs[0][0]]
        assert [s.id for s in steps] == [st for _, st in pairs]
        assert [s.parent_step_id for s in steps] == [None, *[st for _, st in pairs[:-1]]]
        assert [s.history_len for s in steps] == [0, 3, 5, 7]


def test_two_plain_atdp_serve_processes(tmp_path, db_url, fake_upstream, factory):
    """The same with the real command: two `atdp serve` processes, nothing set, turns 0.3 s apart."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    procs = []
    try:
        a, port_a = serve(tmp_path, "a", fake_upstream.url, db_url, tenant)
        procs.append(a)
        assert health(port_a, a)["links"] == {"shared": False, "peers": 0}
        b, port_b = serve(tmp_path, "b", fake_upstream.url, db_url, tenant)
        procs.append(b)
        assert health(port_b, b)["links"] == {"shared": True, "peers": 1}
        assert health(port_a, a)["links"]["shared"]
        msgs = [{"role": "system", "content": "two processes"}]
        sessions = []
        for turn in range(4):
            port = (port_a, port_b)[turn % 2]
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="open-mode", max_retries=0,
                                   default_headers=HERMES)
            msgs.append({"role": "user", "content": f"turn {turn}"})
            raw = client.chat.completions.with_raw_response.create(model="fake", messages=msgs)
            msgs.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
            sessions.append(raw.headers["x-atdp-session-id"])
            time.sleep(0.3)
        assert len(set(sessions)) == 1
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)  # a clean stop stores every step
    (steps,) = sessions_of(factory, tenant).values()
    assert len(steps) == 4 and [s.history_len for s in steps] == [0, 3, 5, 7]


def test_a_conversation_begun_alone_links_on_the_proxy_that_comes_next(start_proxy, fake_upstream, factory):
    """The first proxy served a turn while alone (nothing published, its step not stored yet); a
    second proxy starts, and the next turn, there, links to it: the switch published the recent keys."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = start_proxy([fake_upstream.url], tenant=tenant, flush_interval_s=3.0)
    msgs = [{"role": "system", "content": "begun alone"}, {"role": "user", "content": "turn 0"}]
    text, session, first = chat(a, msgs)
    assert not a.state.links.shared and published(factory, session) == 0  # a lone proxy writes nothing
    b = start_proxy([fake_upstream.url], tenant=tenant, flush_interval_s=3.0)
    assert a.state.links.shared and published(factory, session) == 2  # its keys "t" and "i", at the switch
    assert stored_steps(factory, tenant) == 0
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "turn 1"}]
    _, session_b, second = chat(b, msgs)
    assert session_b == session
    b.flush()
    (steps,) = sessions_of(factory, tenant).values()
    assert [s.parent_step_id for s in steps if s.id == second] == [first]


def test_a_forgotten_session_is_not_published_at_the_switch(start_proxy, fake_upstream, factory):
    """Keys kept for a switch go with a forget: the next proxy's arrival publishes none of them."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = start_proxy([fake_upstream.url], tenant=tenant)
    msgs = [{"role": "system", "content": "forget me"}, {"role": "user", "content": "turn 0"}]
    _, session, _ = chat(a, msgs)
    _, kept, _ = chat(a, [msgs[0], {"role": "user", "content": "another run"}])
    a.flush()
    r = httpx.delete(f"{a.url}/atdp/v1/sessions/{session}", params={"tenant": tenant}, timeout=30,
                     headers={"authorization": "Bearer admin-test-key"})
    assert r.status_code == 200 and r.json()["steps"] == 1, r.text
    start_proxy([fake_upstream.url], tenant=tenant)
    assert a.state.links.shared
    assert published(factory, session) == 0 and published(factory, kept) == 2


def test_a_step_stored_while_alone_is_found_by_a_shared_proxy(start_proxy, fake_upstream, factory):
    """A shared lookup reads the stored steps too: a turn served while its proxy was alone and no
    longer among its recent keys (here: kept for no time) was not published, and still links once stored."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = start_proxy([fake_upstream.url], tenant=tenant, flush_interval_s=3.0)
    a.state.links.recent_s = 0.0
    msgs = [{"role": "system", "content": "stored alone"}, {"role": "user", "content": "turn 0"}]
    text, session, first = chat(a, msgs)
    b = start_proxy([fake_upstream.url], tenant=tenant)  # (its memory, warmed from the stored steps, lacks it)
    assert a.state.links.shared and b.state.links.shared and published(factory, session) == 0
    a.flush()
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "turn 1"}]
    assert chat(b, msgs)[1] == session
    assert b.state.links.lookups == 1


def test_a_lone_proxy_turns_lone_again_once_its_peer_is_gone(start_proxy, fake_upstream, factory):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = start_proxy([fake_upstream.url], tenant=tenant)
    b = start_proxy([fake_upstream.url], tenant=tenant)
    assert a.state.links.shared
    a.state.presence.linger_s = 0.5
    a.state.presence.check_s = 0.1
    b.server.stop()  # its presence lock goes with its connection
    until(lambda: not a.state.links.shared)
    assert a.state.presence.peers == 0
    msgs = [{"role": "system", "content": "alone again"}, {"role": "user", "content": "hello"}]
    _, session, _ = chat(a, msgs)
    a.flush()
    assert published(factory, session) == 0


def test_the_setting_forces_the_mode(start_proxy, fake_upstream, factory):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    on = start_proxy([fake_upstream.url], tenant=tenant, shared_links=True)
    assert on.state.links.shared and on.state.presence.peers == 0  # shared, alone
    off = start_proxy([fake_upstream.url], tenant=tenant, shared_links=False)
    assert not off.state.links.shared and off.state.presence is None  # never counted, never shared
    assert on.state.presence.peers == 0
    msgs = [{"role": "system", "content": "forced"}, {"role": "user", "content": "hello"}]
    _, s_on, _ = chat(on, msgs)
    _, s_off, _ = chat(off, [*msgs[:1], {"role": "user", "content": "hello off"}])
    assert published(factory, s_on) == 2 and published(factory, s_off) == 0
    # A proxy left on auto counts the forced one and shares with it at once.
    auto = start_proxy([fake_upstream.url], tenant=tenant)
    assert auto.state.links.shared and auto.state.presence.peers == 1
