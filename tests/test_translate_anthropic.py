"""Anthropic Messages <-> chat completions: exact request/response translation and streamed events,
checked against the official `anthropic` SDK's parsers."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message

from proxy.translate import TranslationError
from proxy.translate.anthropic import count_tokens_chat_body, messages_to_chat
from proxy.translate.anthropic_stream import MessagesStream, chat_to_message
from proxy.translate.sse import SSEDecoder
from tests import translate_chunks as vllm

SESSION_USER_ID = json.dumps(
    {"device_id": "9f2c", "account_uuid": "", "session_id": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"}
)

BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
    "required": ["command"],
    "additionalProperties": False,
    "$schema": "http://json-schema.org/draft-07/schema#",
}
READ_SCHEMA = {
    "type": "object",
    "properties": {"file_path": {"type": "string"}},
    "required": ["file_path"],
    "additionalProperties": False,
    "$schema": "http://json-schema.org/draft-07/schema#",
}

# The shape Claude Code 2.1 sends (`claude -p`), second turn of a tool round trip.
CLAUDE_CODE_REQUEST: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 32000,
    "stream": True,
    "temperature": 1,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli"},
        {
            "type": "text",
            "text": "You are Claude Code, Anthropic's official CLI for Claude.",
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "text", "text": "You are an interactive CLI tool.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>\nToday is Monday.\n</system-reminder>"},
                {
                    "type": "text",
                    "text": "List the files, then read NOTES.md",
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should run ls first.", "signature": "EqQBCkYIBxgCKkA"},
                {"type": "text", "text": "I'll look around."},
                {
                    "type": "tool_use",
                    "id": "toolu_01A",
                    "name": "Bash",
                    "input": {"command": "ls", "description": "List"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_01B",
                    "name": "Read",
                    "input": {"file_path": "/w/NOTES.md"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "README.md\nsrc"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01B",
                    "is_error": True,
                    "content": [
                        {"type": "text", "text": "<tool_use_error>File does not exist.</tool_use_error>"}
                    ],
                },
                {"type": "text", "text": "Then check src/.", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {"role": "system", "content": "The user switched to plan mode."},
        {
            "role": "assistant",
            "content": [{"type": "redacted_thinking", "data": "c2VjcmV0"}, {"type": "text", "text": "OK."}],
        },
        {"role": "user", "content": "continue"},
    ],
    "tools": [
        {"name": "Bash", "description": "Executes a bash command", "input_schema": BASH_SCHEMA},
        {
            "name": "Read",
            "description": "Reads a file",
            "input_schema": READ_SCHEMA,
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ],
    "metadata": {"user_id": SESSION_USER_ID},
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}

CLAUDE_CODE_CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {
            "role": "system",
            "content": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli\n"
            "You are Claude Code, Anthropic's official CLI for Claude.\n"
            "You are an interactive CLI tool.",
        },
        {
            "role": "user",
            "content": "<system-reminder>\nToday is Monday.\n</system-reminder>\nList the files, then read NOTES.md",
        },
        {
            "role": "assistant",
            "content": "I'll look around.",
            "tool_calls": [
                {
                    "id": "toolu_01A",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls", "description": "List"}'},
                },
                {
                    "id": "toolu_01B",
                    "type": "function",
                    "function": {"name": "Read", "arguments": '{"file_path": "/w/NOTES.md"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_01A", "content": "README.md\nsrc"},
        {
            "role": "tool",
            "tool_call_id": "toolu_01B",
            "content": "Error: <tool_use_error>File does not exist.</tool_use_error>",
        },
        {"role": "user", "content": "Then check src/."},
        {"role": "system", "content": "The user switched to plan mode."},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "continue"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {"name": "Bash", "description": "Executes a bash command", "parameters": BASH_SCHEMA},
        },
        {
            "type": "function",
            "function": {"name": "Read", "description": "Reads a file", "parameters": READ_SCHEMA},
        },
    ],
    "max_tokens": 32000,
    "temperature": 1,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_claude_code_request_translates_exactly() -> None:
    translated = messages_to_chat(CLAUDE_CODE_REQUEST)
    assert translated.body == CLAUDE_CODE_CHAT
    assert translated.tool_names == {"Bash": "Bash", "Read": "Read"}
    assert translated.warnings == [
        "dropped tool: web_search (web_search_20250305)",
        "ignored field: metadata",
        "ignored field: thinking",
        "ignored field: output_config",
        "ignored field: context_management",
    ]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            {
                "model": "m",
                "max_tokens": 5,
                "system": "Be brief.",
                "messages": [{"role": "user", "content": "hi"}],
            },
            {
                "model": "m",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                "max_tokens": 5,
            },
            id="system-string",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                            },
                            {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
                            {"type": "text", "text": "What is this?"},
                        ],
                    }
                ],
            },
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                            {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
                            {"type": "text", "text": "What is this?"},
                        ],
                    }
                ],
                "max_tokens": 5,
            },
            id="images",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 9,
                "temperature": 0.2,
                "top_p": 0.9,
                "top_k": 40,
                "stop_sequences": ["\n\nHuman:", "END"],
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
                "messages": [{"role": "user", "content": "go"}],
            },
            {
                "model": "m",
                "messages": [{"role": "user", "content": "go"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "parallel_tool_calls": False,
                "max_tokens": 9,
                "temperature": 0.2,
                "top_p": 0.9,
                "top_k": 40,
                "stop": ["\n\nHuman:", "END"],
            },
            id="sampling-stop-named-tool",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 9,
                "tool_choice": {"type": "any"},
                "messages": [
                    {"role": "user", "content": "Write JSON"},
                    {"role": "assistant", "content": [{"type": "text", "text": "{"}]},
                ],
            },
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "Write JSON"},
                    {"role": "assistant", "content": "{"},
                ],
                "tool_choice": "required",
                "add_generation_prompt": False,
                "continue_final_message": True,
                "max_tokens": 9,
            },
            id="prefill-and-any",
        ),
        pytest.param(
            {
                "model": "m",
                "max_tokens": 9,
                "tool_choice": {"type": "none"},
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"_raw": "{bad"}}],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t1",
                                "content": [
                                    {"type": "text", "text": "line 1"},
                                    {"type": "text", "text": "line 2"},
                                    {
                                        "type": "image",
                                        "source": {"type": "url", "url": "https://x.test/s.png"},
                                    },
                                ],
                            },
                            {"type": "tool_result", "tool_use_id": "t2", "is_error": True},
                        ],
                    },
                ],
            },
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "t1", "content": "line 1\nline 2"},
                    {"role": "tool", "tool_call_id": "t2", "content": "Error"},
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x.test/s.png"}}],
                    },
                ],
                "tool_choice": "none",
                "max_tokens": 9,
            },
            id="raw-arguments-round-trip-and-tool-result-image",
        ),
    ],
)
def test_request_table(body: dict[str, Any], expected: dict[str, Any]) -> None:
    assert messages_to_chat(body).body == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m", "max_tokens": 5}, "messages: Field required"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
        (
            {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
            "max_tokens: must be",
        ),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages: must be a non-empty list"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]},
            "messages.0.content: Field required",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages.0.content.0",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "tool_choice": {"type": "maybe"},
                "messages": [{"role": "user", "content": "x"}],
            },
            "tool_choice",
        ),
        ([1, 2], "request body must be a JSON object"),
    ],
)
def test_validation_errors(body: Any, message: str) -> None:
    with pytest.raises(TranslationError) as caught:
        messages_to_chat(body)
    assert caught.value.status == 400
    assert message in caught.value.message


def test_unknown_fields_are_accepted_with_a_warning() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "shiny_new_field": 1,
    }
    assert messages_to_chat(body).warnings == ["unknown field: shiny_new_field"]


def test_count_tokens_body_needs_no_max_tokens() -> None:
    body = {k: v for k, v in CLAUDE_CODE_REQUEST.items() if k not in ("max_tokens", "stream")}
    assert count_tokens_chat_body(body) == {
        "model": "tiny",
        "messages": CLAUDE_CODE_CHAT["messages"],
        "tools": CLAUDE_CODE_CHAT["tools"],
    }


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
