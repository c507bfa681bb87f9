"""Chat completions -> OpenAI Responses: non-streamed responses and streamed events, checked against
the official `openai` SDK's parsers (the request side: test_translate_responses.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from openai.types.responses import Response

from proxy.translate.responses_stream import ResponsesStream, chat_to_response
from proxy.translate.sse import SSEDecoder
from tests import translate_chunks as vllm
from tests.client_requests import CODEX_REQUEST, CODEX_TOOL_NAMES

# -- non-streamed responses ---------------------------------------------------------------------

REQUEST = {
    "model": "tiny",
    "input": "hi",
    "tools": CODEX_REQUEST["tools"],
    "parallel_tool_calls": False,
    "store": False,
}


def expected_response(
    status: str, output: list[Any], usage: dict[str, Any] | None, **overrides: Any
) -> dict[str, Any]:
    response = {
        "id": "resp_abc",
        "object": "response",
        "created_at": 1760000000,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "model": "tiny",
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": None,
        "prompt_cache_key": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": CODEX_REQUEST["tools"],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
    }
    response.update(overrides)
    return response


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def completion(message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1760000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "tool_calls": [], **message},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": [5, 6, 7],
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "total_tokens": 15,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
        "prompt_token_ids": vllm.PROMPT_IDS,
    }


def text_message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(
    item_id: str,
    call_id: str,
    name: str,
    arguments: str,
    namespace: str | None = None,
    status: str = "completed",
) -> dict[str, Any]:
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }
    if namespace:
        item["namespace"] = namespace
    return item


@pytest.mark.parametrize(
    ("chat", "status", "output"),
    [
        pytest.param(
            completion({"content": "Hello."}, "stop"),
            "completed",
            [text_message("msg_abc_0", "Hello.")],
            id="text",
        ),
        pytest.param(
            completion({"content": "Hel"}, "length"),
            "incomplete",
            [text_message("msg_abc_0", "Hel", "incomplete")],
            id="length",
        ),
        pytest.param(
            completion(
                {
                    "content": "On it.",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "shell_command", "arguments": '{"command": "ls"}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "mcp__docs__search", "arguments": '{"q": "x"}'},
                        },
                        {
                            "id": "c3",
                            "type": "function",
                            "function": {"name": "tracker__create_issue", "arguments": "{}"},
                        },
                    ],
                },
                "tool_calls",
            ),
            "completed",
            [
                text_message("msg_abc_0", "On it."),
                call_item("fc_abc_1", "c1", "shell_command", '{"command": "ls"}'),
                call_item("fc_abc_2", "c2", "search", '{"q": "x"}', "mcp__docs__"),
                call_item("fc_abc_3", "c3", "create_issue", "{}", "tracker"),
            ],
            id="tool-calls-with-namespaces",
        ),
        pytest.param(
            completion({"content": "4", "reasoning_content": "2+2=4"}, "stop"),
            "completed",
            [
                {
                    "id": "rs_abc_0",
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "2+2=4"}],
                },
                text_message("msg_abc_1", "4"),
            ],
            id="reasoning",
        ),
    ],
)
def test_response_table(chat: dict[str, Any], status: str, output: list[Any]) -> None:
    response = chat_to_response(
        chat, model="tiny", response_id="resp_abc", request=REQUEST, tool_names=CODEX_TOOL_NAMES
    )
    assert response == expected_response(status, output, usage(12, 3, cached=8))
    Response.model_validate(response)  # the SDK's own model accepts it


def test_non_streamed_response_through_the_sdk() -> None:
    chat = completion({"content": "Hello."}, "stop")
    response = chat_to_response(chat, model="tiny", response_id="resp_abc", request=REQUEST, tool_names={})
    client = sdk_client(json.dumps(response).encode())
    parsed = client.responses.create(model="tiny", input="hi")
    assert parsed.output_text == "Hello."
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == 8


# -- streams ------------------------------------------------------------------------------------


def new_stream(request: dict[str, Any] = REQUEST) -> ResponsesStream:
    return ResponsesStream(
        model="tiny",
        response_id="resp_abc",
        request=request,
        tool_names=CODEX_TOOL_NAMES,
        created_at=1760000000,
    )


def run_stream(chunks: list[dict[str, Any]]) -> tuple[ResponsesStream, bytes]:
    stream = new_stream()
    out = stream.start()
    for c in chunks:
        out += stream.feed(c)
    out += stream.finish()
    assert stream.finish() == []
    return stream, b"".join(out)


def events(data: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    decoder = SSEDecoder()
    decoded = decoder.feed(data) + decoder.flush()
    parsed = [(event.event, event.json()) for event in decoded]
    assert [payload["sequence_number"] for _, payload in parsed] == list(range(len(parsed)))
    for name, payload in parsed:
        assert payload.pop("sequence_number") is not None and payload["type"] == name
    return parsed


def ev(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return (kind, {"type": kind, **fields})


OPENING = [
    ev("response.created", response=expected_response("in_progress", [], None)),
    ev("response.in_progress", response=expected_response("in_progress", [], None)),
]
EMPTY_PART = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def test_stream_text_only() -> None:
    stream, data = run_stream(vllm.TEXT_ONLY)
    ids = {"item_id": "msg_abc_0", "output_index": 0}
    final = text_message("msg_abc_0", "Hello, world")
    assert events(data) == [
        *OPENING,
        ev(
            "response.output_item.added",
            output_index=0,
            item={**final, "status": "in_progress", "content": []},
        ),
        ev("response.content_part.added", **ids, content_index=0, part=EMPTY_PART),
        ev("response.output_text.delta", **ids, content_index=0, delta="Hello", logprobs=[]),
        ev("response.output_text.delta", **ids, content_index=0, delta=", world", logprobs=[]),
        ev("response.output_text.done", **ids, content_index=0, text="Hello, world", logprobs=[]),
        ev("response.content_part.done", **ids, content_index=0, part=final["content"][0]),
        ev("response.output_item.done", output_index=0, item=final),
        ev("response.completed", response=expected_response("completed", [final], usage(12, 4))),
    ]
    assert stream.response == expected_response("completed", [final], usage(12, 4))
    assert stream.output_items == [final]


def test_stream_text_and_two_tool_calls() -> None:
    stream, data = run_stream(vllm.TOOL_CALLS)
    text = text_message("msg_abc_0", "Checking.")
    # `get_weather` / `read_file` are not declared tools: names pass through without a namespace.
    call_a = call_item("fc_abc_1", "chatcmpl-tool-a1", "get_weather", '{"city": "Paris"}')
    call_b = call_item("fc_abc_2", "chatcmpl-tool-b2", "read_file", '{"path": "/tmp/a.txt", "lines": 3}')
    a = {"item_id": "fc_abc_1", "output_index": 1}
    b = {"item_id": "fc_abc_2", "output_index": 2}
    assert events(data) == [
        *OPENING,
        ev(
            "response.output_item.added",
            output_index=0,
            item={**text, "status": "in_progress", "content": []},
        ),
        ev(
            "response.content_part.added",
            item_id="msg_abc_0",
            output_index=0,
            content_index=0,
            part=EMPTY_PART,
        ),
        ev(
            "response.output_text.delta",
            item_id="msg_abc_0",
            output_index=0,
            content_index=0,
            delta="Checking.",
            logprobs=[],
        ),
        ev(
            "response.output_text.done",
            item_id="msg_abc_0",
            output_index=0,
            content_index=0,
            text="Checking.",
            logprobs=[],
        ),
        ev(
            "response.content_part.done",
            item_id="msg_abc_0",
            output_index=0,
            content_index=0,
            part=text["content"][0],
        ),
        ev("response.output_item.done", output_index=0, item=text),
        ev(
            "response.output_item.added",
            output_index=1,
            item={**call_a, "status": "in_progress", "arguments": ""},
        ),
        ev("response.function_call_arguments.delta", **a, delta='{"city": "Pa'),
        ev("response.function_call_arguments.delta", **a, delta='ris"}'),
        ev("response.function_call_arguments.done", **a, arguments='{"city": "Paris"}'),
        ev("response.output_item.done", output_index=1, item=call_a),
        ev(
            "response.output_item.added",
            output_index=2,
            item={**call_b, "status": "in_progress", "arguments": ""},
        ),
        ev("response.function_call_arguments.delta", **b, delta='{"path": "/tmp/a'),
        ev("response.function_call_arguments.delta", **b, delta='.txt", "lines": 3}'),
        ev("response.function_call_arguments.done", **b, arguments='{"path": "/tmp/a.txt", "lines": 3}'),
        ev("response.output_item.done", output_index=2, item=call_b),
        ev(
            "response.completed",
            response=expected_response("completed", [text, call_a, call_b], usage(12, 12)),
        ),
    ]
    assert stream.output_items == [text, call_a, call_b]


def test_stream_namespace_call_comes_back_with_namespace() -> None:
    stream = new_stream()
    for c in [
        vllm.first(),
        vllm.tool_start(0, "call_9", "mcp__docs__search", [1]),
        vllm.tool_args(0, '{"q": "x"}', [2], "tool_calls"),
    ]:
        stream.feed(c)
    stream.finish()
    assert stream.output_items == [call_item("fc_abc_0", "call_9", "search", '{"q": "x"}', "mcp__docs__")]


def test_stream_length_is_incomplete() -> None:
    stream, data = run_stream(vllm.LENGTH)
    final = text_message("msg_abc_0", "One two three", "incomplete")
    parsed = events(data)
    assert parsed[-2:] == [
        ev("response.output_item.done", output_index=0, item=final),
        ev("response.incomplete", response=expected_response("incomplete", [final], usage(12, 3))),
    ]
    assert stream.response["status"] == "incomplete"


def test_stream_errors() -> None:
    stream = new_stream()
    out = stream.feed(vllm.TEXT_ONLY[0]) + stream.feed(vllm.TEXT_ONLY[1])
    out += stream.error("The prompt is too long.", code="context_length_exceeded")
    assert stream.feed(vllm.TEXT_ONLY[2]) == [] and stream.finish() == []
    partial = text_message("msg_abc_0", "Hello", "in_progress")
    failed = expected_response(
        "failed",
        [partial],
        usage(12, 1),
        error={"code": "context_length_exceeded", "message": "The prompt is too long."},
    )
    assert events(b"".join(out))[-1] == ev("response.failed", response=failed)

    stream = new_stream()
    upstream_error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    parsed = events(b"".join(stream.feed(upstream_error)))
    assert [name for name, _ in parsed] == ["response.created", "response.in_progress", "response.failed"]
    assert parsed[-1][1]["response"]["error"] == {"code": "server_error", "message": "engine died"}


# -- the official SDK parses what we stream ------------------------------------------------------


def sdk_client(data: bytes) -> openai.OpenAI:
    http = httpx2.Client(transport=vllm.sse_transport(data))
    return openai.OpenAI(api_key="k", base_url="http://proxy.test/v1", http_client=http)


@pytest.mark.parametrize("chunks", [vllm.TEXT_ONLY, vllm.TOOL_CALLS])
def test_sdk_stream_helper_assembles_the_same_response(chunks: list[dict[str, Any]]) -> None:
    stream, data = run_stream(chunks)
    client = sdk_client(data)
    with client.responses.stream(model="tiny", input="hi") as sdk:
        final = sdk.get_final_response()
    assert final.model_dump(exclude_none=True) == Response.model_validate(stream.response).model_dump(
        exclude_none=True
    )


def test_sdk_raw_stream_incomplete_and_failed() -> None:
    _, data = run_stream(vllm.LENGTH)
    raw = list(sdk_client(data).responses.create(model="tiny", input="hi", stream=True))
    assert raw[-1].type == "response.incomplete"
    assert raw[-1].response.incomplete_details.reason == "max_output_tokens"
    assert raw[-1].response.output_text == "One two three"

    stream = new_stream()
    data = b"".join(stream.feed(vllm.TEXT_ONLY[0]) + stream.error("boom"))
    raw = list(sdk_client(data).responses.create(model="tiny", input="hi", stream=True))
    assert [event.type for event in raw] == ["response.created", "response.in_progress", "response.failed"]
    assert raw[-1].response.error.message == "boom"
