"""Chat completions -> Anthropic Messages: non-streamed responses and streamed events, checked against
the official `anthropic` SDK's parsers (the request side: test_translate_anthropic.py)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message

from proxy.translate.anthropic_stream import MessagesStream, chat_to_message
from proxy.translate.sse import SSEDecoder
from tests import translate_chunks as vllm

# -- non-streamed responses ---------------------------------------------------------------------


def completion(message: dict[str, Any], finish_reason: str, stop_reason: Any = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1760000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "reasoning": None, "tool_calls": [], **message},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": [5, 6, 7],
            }
        ],
        "usage": {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3},
        "prompt_token_ids": vllm.PROMPT_IDS,
    }


USAGE = {
    "input_tokens": 12,
    "output_tokens": 3,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}


@pytest.mark.parametrize(
    ("chat", "content", "stop_reason", "stop_sequence"),
    [
        pytest.param(
            completion({"content": "Hi there."}, "stop", 2),
            [{"type": "text", "text": "Hi there."}],
            "end_turn",
            None,
            id="stop",
        ),
        pytest.param(
            completion({"content": "Cut"}, "length"),
            [{"type": "text", "text": "Cut"}],
            "max_tokens",
            None,
            id="length",
        ),
        pytest.param(
            completion({"content": "A: 1"}, "stop", "\n\nHuman:"),
            [{"type": "text", "text": "A: 1"}],
            "stop_sequence",
            "\n\nHuman:",
            id="stop-sequence",
        ),
        pytest.param(
            completion(
                {
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "Read", "arguments": "{not json"},
                        },
                        {"id": "c3", "type": "function", "function": {"name": "Noop", "arguments": ""}},
                    ],
                },
                "tool_calls",
            ),
            [
                {"type": "tool_use", "id": "c1", "name": "Bash", "input": {"command": "ls"}},
                {"type": "tool_use", "id": "c2", "name": "Read", "input": {"_raw": "{not json"}},
                {"type": "tool_use", "id": "c3", "name": "Noop", "input": {}},
            ],
            "tool_use",
            None,
            id="tool-calls",
        ),
        pytest.param(
            completion(
                {
                    "content": "Sure.",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                "stop",
            ),
            [{"type": "text", "text": "Sure."}, {"type": "tool_use", "id": "c1", "name": "f", "input": {}}],
            "tool_use",
            None,
            id="named-tool-choice-ends-with-stop",
        ),
        pytest.param(
            completion({"content": "4", "reasoning": "2+2"}, "stop"),
            [{"type": "thinking", "thinking": "2+2", "signature": ""}, {"type": "text", "text": "4"}],
            "end_turn",
            None,
            id="reasoning",
        ),
    ],
)
def test_response_table(
    chat: dict[str, Any], content: list[Any], stop_reason: str, stop_sequence: str | None
) -> None:
    message = chat_to_message(chat, model="tiny", message_id="msg_01")
    assert message == {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": USAGE,
    }
    Message.model_validate(message)  # the SDK's own model accepts it


def test_non_streamed_message_through_the_sdk() -> None:
    chat = completion({"content": "Hi there."}, "stop", 2)
    body = json.dumps(chat_to_message(chat, model="tiny", message_id="msg_01")).encode()
    client = anthropic.Anthropic(
        api_key="k",
        base_url="http://proxy.test",
        http_client=httpx2.Client(transport=vllm.sse_transport(body)),
    )
    message = client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].text == "Hi there."
    assert message.usage.input_tokens == 12


# -- streams ------------------------------------------------------------------------------------


def run_stream(chunks: list[dict[str, Any]]) -> tuple[MessagesStream, bytes]:
    stream = MessagesStream(model="tiny", message_id="msg_01")
    out: list[bytes] = []
    for c in chunks:
        out += stream.feed(c)
    out += stream.finish()
    assert stream.finish() == []  # idempotent
    return stream, b"".join(out)


def events(data: bytes) -> list[tuple[str | None, Any]]:
    decoder = SSEDecoder()
    decoded = decoder.feed(data) + decoder.flush()
    for event in decoded:
        assert event.json()["type"] == event.event  # the event line names the payload's type
    return [(event.event, event.json()) for event in decoded]


def start_event(input_tokens: int) -> tuple[str, Any]:
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    message = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return ("message_start", {"type": "message_start", "message": message})


def delta_event(stop_reason: str, output_tokens: int, stop_sequence: str | None = None) -> tuple[str, Any]:
    usage = {
        "input_tokens": 12,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    payload = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": usage,
    }
    return ("message_delta", payload)


def block_start(index: int, block: dict[str, Any]) -> tuple[str, Any]:
    return ("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def block_delta(index: int, delta: dict[str, Any]) -> tuple[str, Any]:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> tuple[str, Any]:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


PING = ("ping", {"type": "ping"})
STOP = ("message_stop", {"type": "message_stop"})


def test_stream_text_only() -> None:
    stream, data = run_stream(vllm.TEXT_ONLY)
    assert events(data) == [
        start_event(12),
        block_start(0, {"type": "text", "text": ""}),
        PING,
        block_delta(0, {"type": "text_delta", "text": "Hello"}),
        block_delta(0, {"type": "text_delta", "text": ", world"}),
        block_stop(0),
        delta_event("end_turn", 4),
        STOP,
    ]
    assert stream.message["content"] == [{"type": "text", "text": "Hello, world"}]


def test_stream_text_and_two_tool_calls() -> None:
    stream, data = run_stream(vllm.TOOL_CALLS)
    assert events(data) == [
        start_event(12),
        block_start(0, {"type": "text", "text": ""}),
        PING,
        block_delta(0, {"type": "text_delta", "text": "Checking."}),
        block_stop(0),
        block_start(1, {"type": "tool_use", "id": "chatcmpl-tool-a1", "name": "get_weather", "input": {}}),
        block_delta(1, {"type": "input_json_delta", "partial_json": '{"city": "Pa'}),
        block_delta(1, {"type": "input_json_delta", "partial_json": 'ris"}'}),
        block_stop(1),
        block_start(2, {"type": "tool_use", "id": "chatcmpl-tool-b2", "name": "read_file", "input": {}}),
        block_delta(2, {"type": "input_json_delta", "partial_json": '{"path": "/tmp/a'}),
        block_delta(2, {"type": "input_json_delta", "partial_json": '.txt", "lines": 3}'}),
        block_stop(2),
        delta_event("tool_use", 12),
        STOP,
    ]
    assert stream.message == {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "chatcmpl-tool-a1", "name": "get_weather", "input": {"city": "Paris"}},
            {
                "type": "tool_use",
                "id": "chatcmpl-tool-b2",
                "name": "read_file",
                "input": {"path": "/tmp/a.txt", "lines": 3},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "output_tokens": 12,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def test_stream_length_and_stop_sequence() -> None:
    stream, data = run_stream(vllm.LENGTH)
    assert events(data)[-2:] == [delta_event("max_tokens", 3), STOP]
    assert stream.message["content"] == [{"type": "text", "text": "One two three"}]
    stream, data = run_stream(vllm.STOP_SEQUENCE)
    assert events(data)[-2:] == [delta_event("stop_sequence", 3, "\n\nHuman:"), STOP]


def test_stream_without_usage_counts_token_ids() -> None:
    stream, _ = run_stream(vllm.TOOL_CALLS[:-1])
    assert stream.message["usage"]["output_tokens"] == 12


def test_stream_explicit_start_and_empty_answer() -> None:
    stream = MessagesStream(model="tiny", message_id="msg_01")
    out = stream.start(input_tokens=7) + stream.feed(vllm.first()) + stream.finish()
    parsed = events(b"".join(out))
    assert [name for name, _ in parsed] == ["message_start", "ping", "message_delta", "message_stop"]
    assert parsed[0][1]["message"]["usage"]["input_tokens"] == 7


def test_stream_errors() -> None:
    stream = MessagesStream(model="tiny", message_id="msg_01")
    out = stream.feed(vllm.TEXT_ONLY[0]) + stream.feed(vllm.TEXT_ONLY[1])
    out += stream.error("overloaded_error", "Overloaded")
    assert stream.feed(vllm.TEXT_ONLY[2]) == [] and stream.finish() == []
    assert events(b"".join(out)) == [
        start_event(12),
        block_start(0, {"type": "text", "text": ""}),
        PING,
        block_delta(0, {"type": "text_delta", "text": "Hello"}),
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    ]
    # An error object in the upstream stream itself.
    stream = MessagesStream(model="tiny", message_id="msg_02")
    upstream_error = {"object": "error", "message": "prompt too long", "type": "BadRequestError", "code": 400}
    parsed = events(b"".join(stream.feed(upstream_error)))
    assert parsed[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "prompt too long"}},
    )


# -- the official SDK parses what we stream ------------------------------------------------------


def sdk_client(data: bytes, seen: list[httpx2.Request] | None = None) -> anthropic.Anthropic:
    http = httpx2.Client(transport=vllm.sse_transport(data, seen))
    return anthropic.Anthropic(api_key="k", base_url="http://proxy.test", http_client=http)


@pytest.mark.parametrize("chunks", [vllm.TEXT_ONLY, vllm.TOOL_CALLS, vllm.LENGTH, vllm.STOP_SEQUENCE])
def test_sdk_stream_helper_assembles_the_same_message(chunks: list[dict[str, Any]]) -> None:
    stream, data = run_stream(chunks)
    client = sdk_client(data)
    with client.messages.stream(
        model="tiny", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as sdk:
        final = sdk.get_final_message()
    assert final.model_dump(exclude_none=True) == Message.model_validate(stream.message).model_dump(
        exclude_none=True
    )


def test_sdk_raw_events_and_error_event() -> None:
    _, data = run_stream(vllm.TOOL_CALLS)
    client = sdk_client(data)
    raw = list(
        client.messages.create(
            model="tiny", max_tokens=64, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert [event.type for event in raw][:3] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]
    assert raw[-1].type == "message_stop"

    stream = MessagesStream(model="tiny", message_id="msg_01")
    data = b"".join(stream.feed(vllm.TEXT_ONLY[0]) + stream.error("overloaded_error", "Overloaded"))
    with pytest.raises(anthropic.APIStatusError, match="Overloaded"):
        list(
            sdk_client(data).messages.create(
                model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )


def test_stream_arguments_that_are_not_an_object() -> None:
    # A small model under a named tool_choice wrote `true` (seen with vLLM 0.32); streaming "tr"
    # would break every client's partial JSON parser, so the block carries {"_raw": ...} instead.
    chunks = [
        vllm.first(),
        vllm.tool_start(0, "call_1", "Read", [1]),
        vllm.chunk({}, [2]),  # vLLM sends token ids with an empty delta while its parser buffers
        vllm.tool_args(0, "tr", [3]),
        vllm.tool_args(0, "ue", [4], finish_reason="stop"),
        vllm.usage(4),
    ]
    stream, data = run_stream(chunks)
    assert events(data)[1:-2] == [
        block_start(0, {"type": "tool_use", "id": "call_1", "name": "Read", "input": {}}),
        PING,
        block_delta(0, {"type": "input_json_delta", "partial_json": '{"_raw": "true"}'}),
        block_stop(0),
    ]
    assert stream.message["content"][0]["input"] == {"_raw": "true"}
    assert stream.message["stop_reason"] == "tool_use"
    with sdk_client(data).messages.stream(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    ) as sdk:
        assert sdk.get_final_message().content[0].input == {"_raw": "true"}


def test_stream_arguments_stop_at_the_first_invalid_fragment() -> None:
    chunks = [
        vllm.first(),
        vllm.tool_start(0, "call_1", "f", [1]),
        vllm.tool_args(0, " ", [2]),
        vllm.tool_args(0, '{"a"', [3]),
        vllm.tool_args(0, " 1}", [4], finish_reason="tool_calls"),
    ]
    stream, data = run_stream(chunks)
    deltas = [payload["delta"] for name, payload in events(data) if name == "content_block_delta"]
    assert deltas == [{"type": "input_json_delta", "partial_json": ' {"a"'}]
    assert stream.message["content"][0]["input"] == {"_raw": ' {"a" 1}'}
    with sdk_client(data).messages.stream(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    ) as sdk:
        sdk.get_final_message()  # the client is not broken by the model's invalid JSON
