"""What every door does alike, once per door: a client leaving mid-stream is an aborted step (tokens kept,
replica freed), and an unreachable upstream is a 502 in the door's own error shape plus a failed step."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.session_builders import document

ANSWER = "long answer " * 30


@dataclass(frozen=True)
class Door:
    name: str
    path: str  # under the proxy's /v1
    stream_body: Callable[[str], dict[str, Any]]
    output_bound: int  # the output ids of an aborted answer are fewer than this
    check_output: Callable[[Any], None]  # the aborted step's action output, in the client's shape
    call_dead_upstream: Callable[[Any], None]  # one call through the official SDK; raises its APIStatusError


def _chat_output(output: Any) -> None:
    assert output is None or output.get("role") == "assistant"


def _messages_output(output: Any) -> None:
    assert output["type"] == "message" and output["content"][0]["type"] == "text"


def _responses_output(output: Any) -> None:
    assert output[0]["type"] == "message"  # the Responses shape, as far as it got


def _openai(proxy: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)


def _chat_dead(proxy: Any) -> None:
    _openai(proxy).chat.completions.create(model="fake", messages=[{"role": "user", "content": "anyone?"}])


def _messages_dead(proxy: Any) -> None:
    sdk = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    sdk.messages.create(model="fake", max_tokens=5, messages=[{"role": "user", "content": "x"}])


def _responses_dead(proxy: Any) -> None:
    _openai(proxy).responses.create(model="fake", input="anyone?")


DOORS = [
    Door("chat", "/chat/completions",
         lambda text: {"model": "fake", "stream": True, "messages": [{"role": "user", "content": text}]},
         len(("[w0] " + ANSWER).encode()), _chat_output, _chat_dead),
    Door("messages", "/messages",
         lambda text: {"model": "fake", "max_tokens": 1000, "stream": True,
                       "messages": [{"role": "user", "content": text}]},
         len(ANSWER), _messages_output, _messages_dead),
    Door("responses", "/responses", lambda text: {"model": "fake", "stream": True, "input": text},
         len(ANSWER), _responses_output, _responses_dead),
]


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_client_disconnect_mid_stream_is_an_aborted_step(start_proxy, fake_upstream, factory, door):
    fake_upstream.chunk_size = 1
    fake_upstream.chunk_delay = 0.005  # a model still generating when the client leaves
    proxy = start_proxy([fake_upstream.url])
    with httpx.stream("POST", proxy.v1 + door.path, json=door.stream_body("#say " + ANSWER)) as r:
        for i, _ in enumerate(r.iter_bytes()):
            if i >= 3:
                break
    deadline, steps = time.monotonic() + 10, []
    while time.monotonic() < deadline and not steps:
        steps = proxy.steps(factory)
        time.sleep(0.1)
    (step,) = steps
    assert step.status == "aborted" and 0 < len(step.output_token_ids) < door.output_bound
    assert proxy.state.pool.replicas[0].inflight == 0
    door.check_output(document(factory, step).steps[0].action.output)
    if door.name == "responses":  # an unfinished answer continues nothing
        assert proxy.response_store.flush() and not proxy.response_store._recent


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_upstream_down_is_502_in_the_doors_shape_and_a_failed_step(start_proxy, factory, door):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proxy = start_proxy([dead])
    errors = (openai.APIStatusError, anthropic.APIStatusError)
    with pytest.raises(errors) as e:
        door.call_dead_upstream(proxy)
    assert e.value.status_code == 502
    if door.name == "messages":
        assert e.value.body["error"]["type"] == "api_error"
    else:
        assert e.value.body["type"] == "upstream_error"
    (step,) = proxy.steps(factory)
    assert step.status == "error" and step.error["type"] == "upstream_unavailable"
    assert step.eligibility in ("debug_only", "audit_only")
