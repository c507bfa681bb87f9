"""The proxy's connections to the engine: kept for the next call, and never a failed call.

The engine (uvicorn) closes idle keep-alive connections after 5 s; a connection the proxy's pool hands
out as that happens fails with no answer. A relay in front of the scripted engine plays that race
deterministically: it accepts a connection, reads the request, and hangs up without answering.

A stream ends for the client at the engine's `[DONE]`; the end of the engine's response, which vLLM
writes after it, is read afterwards so the connection serves the next call.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from proxy.streams import END_WAIT_S
from tests.fake_vllm import free_port


class _HangUpRelay(socketserver.ThreadingTCPServer):
    """Hangs up on the first `drops` connections after reading from them; relays the rest."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, target: tuple[str, int], drops: int) -> None:
        self.target = target
        self.drops = drops
        self.connections = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", free_port()), _Handler)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _HangUpRelay = self.server  # type: ignore[assignment]
        with server.lock:
            server.connections += 1
            drop = server.connections <= server.drops
        if drop:
            self.request.recv(65536)  # the request arrived; no answer, the connection closes
            return
        with socket.create_connection(server.target) as up:
            def pump(src: socket.socket, dst: socket.socket) -> None:
                with contextlib.suppress(OSError):
                    while data := src.recv(65536):
                        dst.sendall(data)
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

            back = threading.Thread(target=pump, args=(up, self.request), daemon=True)
            back.start()
            pump(self.request, up)
            back.join(30)


def _relay(url: str, drops: int) -> _HangUpRelay:
    parts = urlsplit(url)
    relay = _HangUpRelay((parts.hostname, parts.port), drops)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    return relay


def test_a_connection_closed_without_an_answer_is_sent_again(start_proxy, fake_upstream):
    relay = _relay(fake_upstream.url, drops=0)
    try:
        host, port = relay.server_address
        proxy = start_proxy([f"http://{host}:{port}"])
        assert proxy.versions.ready.wait(30)
        with relay.lock:  # count from the first model call (start-up asked for /v1/models)
            relay.connections, relay.drops = 0, 2
        client = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "#say hello"}])
        assert out.choices[0].message.content.endswith("] hello")  # the scripted engine names its weights first
        assert relay.connections == 3  # two hang-ups, then an answer: the client saw one call
        with client.chat.completions.create(model="fake", stream=True,
                                            messages=[{"role": "user", "content": "#say streamed"}]) as stream:
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text.endswith("] streamed")
    finally:
        relay.shutdown()
        relay.server_close()


def test_a_replica_that_keeps_hanging_up_fails_the_call_in_the_api_format(start_proxy, fake_upstream):
    relay = _relay(fake_upstream.url, drops=0)
    try:
        host, port = relay.server_address
        proxy = start_proxy([f"http://{host}:{port}"])
        assert proxy.versions.ready.wait(30)
        relay.drops = 10**6
        r = httpx.post(proxy.v1 + "/chat/completions", timeout=30,
                       json={"model": "fake", "messages": [{"role": "user", "content": "#say hello"}]})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["type"] == "upstream_error"
    finally:
        relay.shutdown()
        relay.server_close()


def _stream_through(proxy_url: str, door: str) -> tuple[float, float]:
    """One streamed call through `door`; (seconds until the engine's last event reached the client,
    seconds until the response ended)."""
    path, body = {
        "chat": ("/v1/chat/completions", {"model": "fake", "stream": True,
                                          "messages": [{"role": "user", "content": "#say done"}]}),
        "messages": ("/v1/messages", {"model": "fake", "stream": True, "max_tokens": 64,
                                      "messages": [{"role": "user", "content": "#say done"}]}),
        "responses": ("/v1/responses", {"model": "fake", "stream": True, "input": "#say done"}),
    }[door]
    last_event = ("data: [DONE]", "event: message_stop", "event: response.completed")
    t0 = time.monotonic()
    seen = None
    with httpx.stream("POST", proxy_url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(last_event):
                seen = time.monotonic() - t0
    assert seen is not None
    return seen, time.monotonic() - t0


@pytest.mark.parametrize("door", ["chat", "messages", "responses"])
def test_a_stream_ends_at_the_engines_done_and_its_connection_is_kept(start_proxy, fake_upstream, door):
    # vLLM writes the end of its chunked response after `[DONE]`; here it comes 0.6 s later.
    fake_upstream.end_delay = 0.6
    proxy = start_proxy([fake_upstream.url])
    assert proxy.versions.ready.wait(30)
    replica = proxy.state.pool.replicas[0]
    ended = []
    for _ in range(4):
        seen, total = _stream_through(proxy.url, door)
        ended.append(total)
        assert replica.inflight == 0  # the engine's work is done: its slot is free at once
        time.sleep(0.9)  # the engine's end arrives meanwhile, and the proxy reads it
    # The client's stream ends with the engine's last event, not 0.6 s later with the engine's response.
    assert max(ended) < 0.5, ended
    # ... and the connection, read to its end, served every call (closed, each call would open one).
    assert len(set(fake_upstream.clients)) == 1, fake_upstream.clients


def test_an_engine_that_never_ends_its_response_after_done_costs_only_its_connection(start_proxy, fake_upstream):
    fake_upstream.end_delay = 8.0
    proxy = start_proxy([fake_upstream.url])
    assert proxy.versions.ready.wait(30)
    replica = proxy.state.pool.replicas[0]
    first, total = _stream_through(proxy.url, "chat")
    assert total < 5 and replica.inflight == 0
    time.sleep(END_WAIT_S + 0.5)  # the proxy gave up waiting for the end: that connection is closed
    _stream_through(proxy.url, "chat")
    assert len(set(fake_upstream.clients)) == 2
    steps = proxy.steps(proxy.state.factory)
    assert [s.status for s in steps] == ["ok", "ok"]
