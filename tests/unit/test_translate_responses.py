"""OpenAI Responses <-> chat completions: exact request/response translation and streamed events,
checked against the official `openai` SDK's parsers."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.translate import TranslationError
from proxy.translate.responses import responses_to_chat, upstream_tool_name
from tests.client_requests import CODEX_REQUEST, CODEX_TOOL_NAMES, SEARCH_PARAMS, SHELL_PARAMS

CODEX_CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"},
        {"role": "user", "content": "Run the tests"},
        {
            "role": "assistant",
            "content": "Running them.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "shell_command", "arguments": '{"command":"pytest -q"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "mcp__docs__search", "arguments": '{"q":"pytest"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3 passed"},
        {"role": "tool", "tool_call_id": "call_2", "content": "docs hit"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "shell_command",
                "description": "Runs a shell command",
                "parameters": SHELL_PARAMS,
            },
        },
        {
            "type": "function",
            "function": {
                "name": "mcp__docs__search",
                "description": "Search the docs",
                "parameters": SEARCH_PARAMS,
            },
        },
        {
            "type": "function",
            "function": {"name": "mcp__docs__fetch", "parameters": {"type": "object", "properties": {}}},
        },
        {
            "type": "function",
            "function": {
                "name": "tracker__create_issue",
                "description": "File an issue",
                "parameters": SEARCH_PARAMS,
            },
        },
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_codex_request_translates_exactly() -> None:
    translated = responses_to_chat(CODEX_REQUEST)
    assert translated.body == CODEX_CHAT
    assert translated.tool_names == CODEX_TOOL_NAMES
    assert translated.warnings == [
        "dropped tool: web_search (web_search)",
        "ignored field: reasoning",
        "ignored field: store",
        "ignored field: include",
        "ignored field: prompt_cache_key",
        "ignored field: client_metadata",
    ]


def test_namespace_names() -> None:
    assert upstream_tool_name(None, "f") == "f"
    assert upstream_tool_name("crm", "lookup") == "crm__lookup"
    assert upstream_tool_name("mcp__docs__", "search") == "mcp__docs__search"


@pytest.mark.parametrize(
    ("body", "history", "expected"),
    [
        pytest.param(
            {
                "model": "m",
                "instructions": "Be terse.",
                "input": "hi",
                "max_output_tokens": 20,
                "temperature": 0.3,
                "top_p": 0.8,
            },
            None,
            {
                "model": "m",
                "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
                "max_tokens": 20,
                "temperature": 0.3,
                "top_p": 0.8,
            },
            id="instructions-and-string-input",
        ),
        pytest.param(
            {
                "model": "m",
                "instructions": "New instructions.",
                "input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}],
                "previous_response_id": "resp_1",
            },
            [
                {"role": "user", "content": "What is 6*7? Use the tool."},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "c1",
                    "name": "calc",
                    "arguments": '{"e":"6*7"}',
                    "status": "completed",
                },
            ],
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "New instructions."},
                    {"role": "user", "content": "What is 6*7? Use the tool."},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "calc", "arguments": '{"e":"6*7"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                ],
            },
            id="previous-response-history",
        ),
        pytest.param(
            {
                "model": "m",
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "Describe"},
                            {
                                "type": "input_image",
                                "image_url": "data:image/png;base64,iVBO",
                                "detail": "low",
                            },
                        ],
                    },
                    {"role": "system", "content": "sys"},
                ],
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "f"},
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "out",
                        "schema": {"type": "object"},
                        "strict": True,
                    }
                },
            },
            None,
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Describe"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,iVBO", "detail": "low"},
                            },
                        ],
                    },
                    {"role": "system", "content": "sys"},
                ],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
                },
            },
            id="image-named-tool-json-schema",
        ),
        pytest.param(
            {
                "model": "m",
                "input": "x",
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            None,
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            id="required-json-object",
        ),
    ],
)
def test_request_table(
    body: dict[str, Any], history: list[dict[str, Any]] | None, expected: dict[str, Any]
) -> None:
    translated = responses_to_chat(body, history=history)
    assert translated.body == expected
    assert "dropped item" not in " ".join(translated.warnings)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m"}, "Missing required parameter: 'input'"),
        ({"model": "m", "input": []}, "input: must not be empty"),
        ({"model": "m", "input": 5}, "input: must be a string or a list"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"model": "m", "input": [{"type": "function_call", "call_id": "c"}]}, "needs call_id and name"),
        ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools.0.type"),
        ({"model": "m", "input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"model": "m", "input": "x", "tool_choice": 3}, "tool_choice"),
    ],
)
def test_validation_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(TranslationError) as caught:
        responses_to_chat(body)
    assert caught.value.status == 400
    assert message in caught.value.message


def test_hosted_tools_are_dropped_with_warnings() -> None:
    body = {
        "model": "m",
        "input": "x",
        "tools": [
            {"type": "web_search_preview"},
            {"type": "file_search", "vector_store_ids": ["vs"]},
            {"type": "code_interpreter", "container": {"type": "auto"}},
            {"type": "image_generation"},
            {"type": "local_shell"},
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
            {"type": "mcp", "server_label": "deepwiki", "server_url": "https://x.test"},
        ],
        "tool_choice": {"type": "web_search_preview"},
    }
    translated = responses_to_chat(body)
    assert "tools" not in translated.body
    assert translated.body["tool_choice"] == "auto"
    assert translated.warnings == [
        "dropped tool: web_search_preview (web_search_preview)",
        "dropped tool: file_search (file_search)",
        "dropped tool: code_interpreter (code_interpreter)",
        "dropped tool: image_generation (image_generation)",
        "dropped tool: local_shell (local_shell)",
        "dropped tool: apply_patch (custom)",
        "dropped tool: deepwiki (mcp)",
        "tool_choice 'web_search_preview' is not supported upstream; using 'auto'",
    ]
