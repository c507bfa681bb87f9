"""What every door does alike, once per door (chat, messages, responses), from one table of per-door
client calls: a client leaving mid-stream is an aborted step (tokens kept, replica freed); an
unreachable upstream is a 502 in the door's own error shape plus a failed step; vLLM's own 400 reaches
the official SDK as its bad-request error; an upstream that dies mid-stream ends the stream the door's
way and leaves a failed step with its tokens; malformed JSON and a wrong key are 400 / 401 in the door's
shape; a `/s/{id}/v1` base URL names the session. Door-specific behaviour stays in each door's file."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from proxy.translate.sse import SSEDecoder
from tests.session_builders import document

ANSWER = "long answer " * 30


@dataclass(frozen=True)
class Door:
    name: str
    api: str  # the step's api
    path: str  # under the proxy's /v1
    flavor: str  # the error shape: "openai" or "anthropic"
    body: Callable[..., dict[str, Any]]  # (text, **fields) -> a request body
    output_bound: int  # the output ids of an aborted answer are fewer than this
    check_output: Callable[[Any], None]  # the aborted step's action output, in the client's shape
    call: Callable[[Any, str, str], Any]  # (proxy, text, api_key): one non-streamed call through the official SDK
    bad_request_type: str  # the error type the SDK sees for vLLM's own 400
    stream_dies: Callable[[Any], None]  # stream "#drop" (the upstream dies mid-stream); checks how the stream ends


def sse_events(data: bytes) -> list[tuple[str | None, Any]]:
    decoder = SSEDecoder()
    return [(e.event, e.json()) for e in decoder.feed(data) + decoder.flush()]


def _chat_output(output: Any) -> None:
    assert output is None or output.get("role") == "assistant"


def _messages_output(output: Any) -> None:
    assert output["type"] == "message" and output["content"][0]["type"] == "text"


def _responses_output(output: Any) -> None:
    assert output[0]["type"] == "message"  # the Responses shape, as far as it got


def _openai(proxy: Any, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.v1, api_key=api_key, max_retries=0)


def _anthropic(proxy: Any, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=api_key, max_retries=0)


def _chat_call(proxy: Any, text: str, api_key: str) -> Any:
    return _openai(proxy, api_key).chat.completions.create(model="fake", messages=[{"role": "user", "content": text}])


def _messages_call(proxy: Any, text: str, api_key: str) -> Any:
    return _anthropic(proxy, api_key).messages.create(model="fake", max_tokens=5,
                                                      messages=[{"role": "user", "content": text}])


def _responses_call(proxy: Any, text: str, api_key: str) -> Any:
    return _openai(proxy, api_key).responses.create(model="fake", input=text)


def _chat_stream_dies(proxy: Any) -> None:
    with pytest.raises(Exception):  # noqa: B017 (the stream breaks; the SDK's exact error type varies)
        for _ in _openai(proxy).chat.completions.create(model="fake", messages=[{"role": "user", "content": "#drop"}],
                                                        stream=True):
            pass


def _messages_stream_dies(proxy: Any) -> None:
    r = httpx.post(proxy.v1 + "/messages?beta=true", json=MESSAGES.body("#drop", max_tokens=500, stream=True))
    events = sse_events(r.content)
    assert events[0][0] == "message_start" and events[-1][0] == "error"  # an `error` event ends the stream
    assert events[-1][1]["error"]["type"] == "api_error"


def _responses_stream_dies(proxy: Any) -> None:
    r = httpx.post(proxy.v1 + "/responses", json=RESPONSES.body("#drop", stream=True))
    events = sse_events(r.content)
    assert events[-1][0] == "response.failed" and events[-1][1]["response"]["status"] == "failed"


CHAT = Door("chat", "chat.completions", "/chat/completions", "openai",
            lambda text, **kw: {"model": "fake", "messages": [{"role": "user", "content": text}], **kw},
            len(("[w0] " + ANSWER).encode()), _chat_output, _chat_call, "BadRequestError", _chat_stream_dies)
MESSAGES = Door("messages", "messages", "/messages", "anthropic",
                lambda text, **kw: {"model": "fake", "max_tokens": 1000,
                                    "messages": [{"role": "user", "content": text}], **kw},
                len(ANSWER), _messages_output, _messages_call, "invalid_request_error", _messages_stream_dies)
RESPONSES = Door("responses", "responses", "/responses", "openai",
                 lambda text, **kw: {"model": "fake", "input": text, **kw},
                 len(ANSWER), _responses_output, _responses_call, "invalid_request_error", _responses_stream_dies)
DOORS = [CHAT, MESSAGES, RESPONSES]
SDK_ERRORS = (openai.APIStatusError, anthropic.APIStatusError)


def error_of(door: Door, body: Any) -> dict[str, Any]:
    """The error object of a door's error body, as its SDK hands it over (`APIStatusError.body`)."""
    if door.flavor == "anthropic":
        assert body["type"] == "error"
        return body["error"]
    return body


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_client_disconnect_mid_stream_is_an_aborted_step(start_proxy, fake_upstream, factory, door):
    fake_upstream.chunk_size = 1
    fake_upstream.chunk_delay = 0.005  # a model still generating when the client leaves
    proxy = start_proxy([fake_upstream.url])
    with httpx.stream("POST", proxy.v1 + door.path, json=door.body("#say " + ANSWER, stream=True)) as r:
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
def test_a_client_leaving_while_the_engine_is_silent_ends_the_call_at_once(start_proxy, fake_upstream, factory,
                                                                          door):
    """The proxy notices the client leaving while it waits on the engine, not at the engine's next
    chunk: the step is aborted and the replica freed long before the engine would have spoken again."""
    fake_upstream.chunk_size = 10_000  # the whole answer in one chunk, then the engine pauses
    fake_upstream.chunk_delay = 4.0
    proxy = start_proxy([fake_upstream.url])
    with httpx.stream("POST", proxy.v1 + door.path, json=door.body("#say " + ANSWER, stream=True)) as r:
        next(r.iter_bytes())
    left = time.monotonic()
    steps: list[Any] = []
    while time.monotonic() < left + 3 and not steps:
        steps = proxy.steps(factory)
        time.sleep(0.05)
    (step,) = steps
    assert time.monotonic() - left < 3 < fake_upstream.chunk_delay
    assert step.status == "aborted" and step.error["type"] == "client_disconnected"
    assert proxy.state.pool.replicas[0].inflight == 0


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_upstream_down_is_502_in_the_doors_shape_and_a_failed_step(start_proxy, factory, door):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proxy = start_proxy([dead])
    with pytest.raises(SDK_ERRORS) as e:
        door.call(proxy, "anyone?", "unused")
    assert e.value.status_code == 502
    if door.name == "messages":
        assert e.value.body["error"]["type"] == "api_error"
    else:
        assert e.value.body["type"] == "upstream_error"
    (step,) = proxy.steps(factory)
    assert step.status == "error" and step.error["type"] == "upstream_unavailable"
    assert step.eligibility in ("debug_only", "audit_only")


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_upstream_400_is_the_sdks_bad_request_and_a_failed_step(start_proxy, fake_upstream, factory, door):
    proxy = start_proxy([fake_upstream.url])
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as e:
        door.call(proxy, "#fail400", "unused")
    error = error_of(door, e.value.body)
    assert error["type"] == door.bad_request_type and error["message"] == "scripted bad request"
    if door.flavor == "anthropic":  # exactly Anthropic's shape, nothing of vLLM's left in it
        assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": "scripted bad request"}}
    (step,) = proxy.steps(factory)
    assert step.status == "error" and step.error["status_code"] == 400 and step.api == door.api
    assert e.value.response.headers["x-atdp-step-id"] == step.id


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_upstream_dying_mid_stream_is_a_failed_step_with_its_tokens(start_proxy, fake_upstream, factory, door):
    proxy = start_proxy([fake_upstream.url])
    door.stream_dies(proxy)
    (step,) = proxy.steps(factory)
    assert step.status == "error" and step.api == door.api
    assert len(step.output_token_ids) > 0  # what arrived before the break is kept


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_malformed_json_is_400_in_the_doors_shape(start_proxy, fake_upstream, factory, door):
    proxy = start_proxy([fake_upstream.url])
    r = httpx.post(proxy.v1 + door.path, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    body = r.json()
    error = error_of(door, body) if door.flavor == "anthropic" else body["error"]
    assert error["type"] == "invalid_request_error" and "malformed JSON" in error["message"]
    assert proxy.steps(factory) == []  # nothing reached the upstream, nothing to record


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_unknown_key_is_401_in_the_doors_shape(start_proxy, fake_upstream, door):
    proxy = start_proxy([fake_upstream.url], open_mode=False)

    def check(error: dict[str, Any]) -> None:
        if door.flavor == "anthropic":
            assert error["type"] == "authentication_error"
        else:
            assert error["code"] == "invalid_api_key"

    with pytest.raises((openai.AuthenticationError, anthropic.AuthenticationError)) as e:
        door.call(proxy, "x", "wrong-key")
    assert e.value.status_code == 401
    check(error_of(door, e.value.body))
    r = httpx.post(proxy.v1 + door.path, json=door.body("x"))  # no key at all
    assert r.status_code == 401
    check(error_of(door, r.json()) if door.flavor == "anthropic" else r.json()["error"])


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_session_path_names_the_session(start_proxy, fake_upstream, factory, door):
    proxy = start_proxy([fake_upstream.url])
    session = f"path-{door.name}"
    r = httpx.post(proxy.url + f"/s/{session}/v1" + door.path, json=door.body("p"))
    assert r.status_code == 200 and r.headers["x-atdp-session-id"] == session
    (step,) = proxy.steps(factory, session)
    assert step.api == door.api and r.headers["x-atdp-step-id"] == step.id


@pytest.mark.parametrize("door", DOORS, ids=[d.name for d in DOORS])
def test_the_stream_interval_is_asked_of_the_engine_for_streamed_calls_only(start_proxy, fake_upstream, door):
    """ATDP_STREAM_INTERVAL reaches vLLM as the request's `stream_interval` (a floor: the client's larger
    value stands) on streamed calls; a whole answer has no chunks, so its request is left as the door
    made it."""
    proxy = start_proxy([fake_upstream.url], stream_interval=6)
    httpx.post(proxy.v1 + door.path, json=door.body("streamed", stream=True), timeout=30).raise_for_status()
    httpx.post(proxy.v1 + door.path, json=door.body("whole"), timeout=30).raise_for_status()
    streamed, whole = fake_upstream.requests[-2:]
    assert streamed["stream_interval"] == 6 and "stream_interval" not in whole
    if door is CHAT:  # vLLM's own field: the chat door passes the client's through
        r = httpx.post(proxy.v1 + door.path, json=door.body("larger " * 12, stream=True, stream_interval=9), timeout=30)
        r.raise_for_status()
        assert fake_upstream.requests[-1]["stream_interval"] == 9
        # the answer's text came in chunks of 9 of the engine's own chunks (4 ids each)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        texts = [c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices")]
        assert max(len(t.encode()) for t in texts if t) == 36
