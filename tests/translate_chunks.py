"""vLLM chat completion chunks for the translation tests, shaped as vLLM streams them.

Every chunk carries `token_ids` and `logprobs` (what `return_token_ids` / `logprobs` add), the first
one `prompt_token_ids`, the last one only `usage` (`stream_options.include_usage`): the translators
must ignore the capture fields and not break on them.
"""

from __future__ import annotations

from typing import Any

import httpx2

PROMPT_IDS = list(range(100, 112))  # 12 prompt tokens


def chunk(
    delta: dict[str, Any],
    token_ids: list[int],
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    logprobs = {
        "content": [{"token": f"t{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in token_ids]
    }
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": logprobs if token_ids else None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
    }
    return {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion.chunk",
        "created": 1760000000,
        "model": "tiny",
        "choices": [choice],
        **extra,
    }


def first() -> dict[str, Any]:
    return chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=PROMPT_IDS)


def usage(completion_tokens: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion.chunk",
        "created": 1760000000,
        "model": "tiny",
        "choices": [],
        "usage": {
            "prompt_tokens": 12,
            "total_tokens": 12 + completion_tokens,
            "completion_tokens": completion_tokens,
        },
    }


def tool_start(index: int, call_id: str, name: str, token_ids: list[int]) -> dict[str, Any]:
    call = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    return chunk({"tool_calls": [call]}, token_ids)


def tool_args(
    index: int, fragment: str, token_ids: list[int], finish_reason: str | None = None
) -> dict[str, Any]:
    return chunk(
        {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}, token_ids, finish_reason
    )


TEXT_ONLY = [
    first(),
    chunk({"content": "Hello"}, [1]),
    chunk({"content": ", world"}, [2, 3]),
    chunk({"content": ""}, [4], finish_reason="stop", stop_reason=None),
    usage(4),
]

TOOL_CALLS = [
    first(),
    chunk({"content": "Checking."}, [1, 2]),
    tool_start(0, "chatcmpl-tool-a1", "get_weather", [3, 4]),
    tool_args(0, '{"city": "Pa', [5, 6]),
    tool_args(0, 'ris"}', [7]),
    tool_start(1, "chatcmpl-tool-b2", "read_file", [8]),
    tool_args(1, '{"path": "/tmp/a', [9, 10]),
    tool_args(1, '.txt", "lines": 3}', [11, 12], finish_reason="tool_calls"),
    usage(12),
]

LENGTH = [
    first(),
    chunk({"content": "One two"}, [1, 2]),
    chunk({"content": " three"}, [3], finish_reason="length"),
    usage(3),
]

STOP_SEQUENCE = [
    first(),
    chunk({"content": "Answer: 42"}, [1, 2, 3]),
    chunk({"content": ""}, [], finish_reason="stop", stop_reason="\n\nHuman:"),
    usage(3),
]


def sse_transport(body: bytes, seen: list[httpx2.Request] | None = None) -> httpx2.MockTransport:
    """An httpx2 transport (the SDKs use httpx2) that answers every request with `body` as an event stream (or JSON)."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        if seen is not None:
            seen.append(request)
        content_type = "application/json" if body.startswith(b"{") else "text/event-stream"
        return httpx2.Response(200, content=body, headers={"content-type": content_type})

    return httpx2.MockTransport(handler)


def sse_client(body: bytes) -> httpx2.Client:
    """An SDK-compatible HTTP client whose every answer is `body`."""
    return httpx2.Client(transport=sse_transport(body))
