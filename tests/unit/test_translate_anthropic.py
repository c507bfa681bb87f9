"""Anthropic Messages <-> chat completions: exact request/response translation and streamed events,
checked against the official `anthropic` SDK's parsers."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.translate import TranslationError
from proxy.translate.anthropic import count_tokens_chat_body, messages_to_chat
from tests.client_requests import BASH_SCHEMA, CLAUDE_CODE_REQUEST, READ_SCHEMA

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
