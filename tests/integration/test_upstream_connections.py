"""A pooled connection the engine has just closed must not fail a call.

The engine (uvicorn) closes idle keep-alive connections after 5 s; a connection the proxy's pool hands
out as that happens fails with no answer. A relay in front of the scripted engine plays that race
deterministically: it accepts a connection, reads the request, and hangs up without answering.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from urllib.parse import urlsplit

import httpx
import openai

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
