"""The translators on real vLLM chunks (tiny model): Claude Code and Codex shaped requests go to
vLLM's chat completions, the streamed chunks through MessagesStream / ResponsesStream, and the
official SDKs must parse the result into the same message / response.

Run with the vLLM plugin: `pytest -p tests.vllm_fixtures -m vllm tests/integration/test_translate_vllm.py`.
"""

from __future__ import annotations

import copy
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response

from proxy.translate.anthropic import messages_to_chat
from proxy.translate.anthropic_stream import MessagesStream, chat_to_message
from proxy.translate.responses import responses_to_chat
from proxy.translate.responses_stream import ResponsesStream, chat_to_response
from proxy.translate.sse import SSEDecoder
from tests import translate_chunks
from tests.client_requests import CLAUDE_CODE_REQUEST, CODEX_REQUEST

pytestmark = pytest.mark.vllm

CAPTURE = {"return_token_ids": True, "logprobs": True}  # what the proxy adds; must not disturb us


def stream_chunks(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    decoder, chunks = SSEDecoder(), []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json={**body, **CAPTURE}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for data in r.iter_bytes():
            chunks += [event.json() for event in decoder.feed(data) if event.data != "[DONE]"]
    return chunks


def complete(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(base_url + "/v1/chat/completions", json={**body, **CAPTURE}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def claude_code(**overrides: Any) -> dict[str, Any]:
    return {**copy.deepcopy(CLAUDE_CODE_REQUEST), **overrides}


def codex(**overrides: Any) -> dict[str, Any]:
    return {**copy.deepcopy(CODEX_REQUEST), **overrides}


@pytest.mark.parametrize(
    ("request_body", "stop_reason"),
    [
        # Greedy: at temperature 1 the random tiny model sometimes samples its end token early.
        pytest.param(claude_code(max_tokens=24, temperature=0), "max_tokens", id="text"),
        pytest.param(
            claude_code(max_tokens=256, tool_choice={"type": "tool", "name": "Read"}),
            "tool_use",
            id="named-tool",
        ),
    ],
)
def test_messages_on_real_chunks(vllm_server, request_body: dict[str, Any], stop_reason: str) -> None:
    translated = messages_to_chat(request_body)
    chunks = stream_chunks(vllm_server.base_url, translated.body)
    stream = MessagesStream(model="tiny", message_id="msg_live", tool_names=translated.tool_names)
    out: list[bytes] = []
    for chunk in chunks:
        out += stream.feed(chunk)
    out += stream.finish()
    message = stream.message
    assert message["stop_reason"] == stop_reason
    assert message["usage"]["input_tokens"] == len(chunks[0]["prompt_token_ids"])
    assert message["usage"]["output_tokens"] == sum(
        len(c["choices"][0].get("token_ids") or ()) for c in chunks if c["choices"]
    )
    if stop_reason == "tool_use":
        assert [block["name"] for block in message["content"] if block["type"] == "tool_use"] == ["Read"]

    http = translate_chunks.sse_client(b"".join(out))
    client = anthropic.Anthropic(api_key="k", base_url="http://proxy.test", http_client=http)
    with client.messages.stream(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    ) as sdk:
        final = sdk.get_final_message()
    assert final.model_dump(exclude_none=True) == Message.model_validate(message).model_dump(
        exclude_none=True
    )

    whole = chat_to_message(complete(vllm_server.base_url, translated.body), model="tiny", message_id="msg_2")
    Message.model_validate(whole)
    assert whole["stop_reason"] == stop_reason


@pytest.mark.parametrize(
    ("request_body", "status"),
    [
        pytest.param(codex(max_output_tokens=3, temperature=0), "incomplete", id="length"),
        pytest.param(
            codex(
                max_output_tokens=256,
                tool_choice={"type": "function", "name": "search", "namespace": "mcp__docs__"},
            ),
            "completed",
            id="named-namespace-tool",
        ),
    ],
)
def test_responses_on_real_chunks(vllm_server, request_body: dict[str, Any], status: str) -> None:
    translated = responses_to_chat(request_body)
    chunks = stream_chunks(vllm_server.base_url, translated.body)
    stream = ResponsesStream(
        model="tiny", response_id="resp_live", request=request_body, tool_names=translated.tool_names
    )
    out = stream.start()
    for chunk in chunks:
        out += stream.feed(chunk)
    out += stream.finish()
    assert stream.response["status"] == status
    if status == "completed":
        (call,) = stream.output_items
        assert (call["type"], call["namespace"], call["name"]) == ("function_call", "mcp__docs__", "search")

    http = translate_chunks.sse_client(b"".join(out))
    client = openai.OpenAI(api_key="k", base_url="http://proxy.test/v1", http_client=http)
    if status == "completed":
        with client.responses.stream(model="tiny", input="x") as sdk:
            final = sdk.get_final_response()
        assert final.model_dump(exclude_none=True) == Response.model_validate(stream.response).model_dump(
            exclude_none=True
        )
    else:
        events = list(client.responses.create(model="tiny", input="x", stream=True))
        assert events[-1].type == "response.incomplete"

    chat = complete(vllm_server.base_url, translated.body)
    whole = chat_to_response(
        chat, model="tiny", response_id="resp_2", request=request_body, tool_names=translated.tool_names
    )
    Response.model_validate(whole)
    assert whole["status"] == status
