"""Recorded client request bodies (Claude Code, Codex), shared by the translation and door tests."""

from __future__ import annotations

import json
from typing import Any

# The shape Claude Code 2.1 sends (`claude -p`), second turn of a tool round trip.
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


# The shape Codex CLI 0.171 sends (`codex exec`), second turn of a tool round trip.
SHELL_PARAMS = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "workdir": {"type": "string"}},
    "required": ["command"],
    "additionalProperties": False,
}


SEARCH_PARAMS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


CODEX_REQUEST: dict[str, Any] = {
    "model": "tiny",
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are Codex."}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {
                    "type": "input_text",
                    "text": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>",
                }
            ],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Run the tests"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": "gAAAA"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "content": [{"type": "output_text", "text": "Running them.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "shell_command",
            "arguments": '{"command":"pytest -q"}',
        },
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "search",
            "namespace": "mcp__docs__",
            "arguments": '{"q":"pytest"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "3 passed"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "docs hit"}],
        },
    ],
    "tools": [
        {
            "type": "function",
            "name": "shell_command",
            "description": "Runs a shell command",
            "strict": False,
            "parameters": SHELL_PARAMS,
        },
        {
            "type": "namespace",
            "name": "mcp__docs__",
            "description": "Docs MCP server",
            "tools": [
                {
                    "type": "function",
                    "name": "search",
                    "description": "Search the docs",
                    "parameters": SEARCH_PARAMS,
                },
                {"type": "function", "name": "fetch", "parameters": None},
            ],
        },
        {
            "type": "namespace",
            "name": "tracker",
            "description": "Issue tracker",
            "tools": [
                {
                    "type": "function",
                    "name": "create_issue",
                    "description": "File an issue",
                    "parameters": SEARCH_PARAMS,
                }
            ],
        },
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199a1b2-c3d4",
    "text": {"verbosity": "medium"},
    "client_metadata": {"session_id": "0199a1b2-c3d4"},
}


CODEX_TOOL_NAMES = {
    "shell_command": (None, "shell_command"),
    "mcp__docs__search": ("mcp__docs__", "search"),
    "mcp__docs__fetch": ("mcp__docs__", "fetch"),
    "tracker__create_issue": ("tracker", "create_issue"),
}
