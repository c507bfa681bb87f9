"""Local stand-ins for hosted providers: an OpenAI-compatible `/v1/chat/completions` and an
Anthropic-compatible `/v1/messages`, each a real HTTP server (Starlette on uvicorn, in a thread),
reached by LiteLLM through `api_base`. They answer in each API's real shapes, streamed (SSE) or not,
with text or a tool call, and check the credential header like the hosted ones do.

`mode` scripts the next answers: "text", "tool", "error:<status>", "slow" (answers after `slow_s`),
"break" (a stream that stops mid-answer, connection dropped), "drip" (a stream with `slow_s` between
words; `closed` counts the streams whose client went away).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.fake_vllm import ServerThread

ANSWER = "Checked: the tests pass."


def token_count(body: dict[str, Any]) -> int:
    return len(orjson.dumps(body.get("messages"))) // 4 + 7


class BrokenStream(Exception):
    """Raised inside a stand-in's stream body: uvicorn drops the connection mid-answer."""


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return " ".join(str(p.get("text") or p.get("content") or "") for p in c if isinstance(p, dict))
    return ""


class StandIn:
    """What both stand-ins share: the credential they expect, the script, the requests seen."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.mode = "text"
        self.slow_s = 3.0
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.server: ServerThread | None = None
        self.closed = 0

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start(self, app: Starlette) -> StandIn:
        self.server = ServerThread(app).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def tool_name(self, body: dict[str, Any]) -> str:
        tools = body.get("tools") or []
        first = tools[0] if tools else {}
        return (first.get("function") or {}).get("name") or first.get("name") or "shell"


class OpenAIStandIn(StandIn):
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            # Like OpenAI's: the message quotes the key it was given.
            received = (request.headers.get("authorization") or "").removeprefix("Bearer ")
            return self._error(401, f"Incorrect API key provided: {received}", "invalid_request_error")
        mode = self.mode
        if mode.startswith("error:"):
            status = int(mode.split(":")[1])
            return self._error(status, f"stand-in refused the request ({status})",
                               "invalid_request_error" if status < 500 else "server_error")
        if mode == "slow":
            await asyncio.sleep(self.slow_s)
        cid, model = f"chatcmpl-{uuid.uuid4().hex[:12]}", body.get("model")
        tool = mode == "tool"
        args = '{"cmd": "pytest -q"}'
        usage = {"prompt_tokens": 120 + len(_last_user_text(body.get("messages") or [])), "completion_tokens": 9,
                 "total_tokens": 0}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if not body.get("stream"):
            msg: dict[str, Any] = {"role": "assistant", "content": None if tool else ANSWER}
            if tool:
                msg["tool_calls"] = [{"id": "call_sa1", "type": "function",
                                      "function": {"name": self.tool_name(body), "arguments": args}}]
            return Response(orjson.dumps({
                "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if tool else "stop"}],
                "usage": usage}), media_type="application/json")

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            c = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            return b"data: " + orjson.dumps(c) + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            yield chunk({"role": "assistant", "content": ""})
            if tool:
                yield chunk({"tool_calls": [{"index": 0, "id": "call_sa1", "type": "function",
                                             "function": {"name": self.tool_name(body), "arguments": ""}}]})
                for piece in (args[:9], args[9:]):
                    yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            else:
                for i, word in enumerate(ANSWER.split(" ")):
                    yield chunk({"content": word if i == 0 else " " + word})
                    if mode == "break" and i == 1:
                        raise BrokenStream("stand-in dropped the stream")
                    if mode == "drip":
                        try:
                            await asyncio.sleep(self.slow_s)
                        except asyncio.CancelledError:  # the proxy closed the connection
                            self.closed += 1
                            raise
            yield chunk({}, "tool_calls" if tool else "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + orjson.dumps({"id": cid, "object": "chat.completion.chunk",
                                                "created": int(time.time()), "model": model, "choices": [],
                                                "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @staticmethod
    def _error(status: int, message: str, kind: str) -> Response:
        return Response(orjson.dumps({"error": {"message": message, "type": kind, "code": None}}),
                        status_code=status, media_type="application/json")


class AnthropicStandIn(StandIn):
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/messages", self.messages, methods=["POST"]),
                                 Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])])

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's counting API: a count the test can recompute (a token per 4 bytes of the body)."""
        raw = await request.body()
        self.requests.append(orjson.loads(raw))
        self.headers.append(dict(request.headers))
        if request.headers.get("x-api-key") != self.api_key:
            return self._error(401, "authentication_error", "invalid x-api-key")
        return Response(orjson.dumps({"input_tokens": token_count(orjson.loads(raw))}), media_type="application/json")

    async def messages(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if request.headers.get("x-api-key") != self.api_key:
            return self._error(401, "authentication_error", "invalid x-api-key")
        mode = self.mode
        if mode.startswith("error:"):
            status = int(mode.split(":")[1])
            kind = {400: "invalid_request_error", 429: "rate_limit_error", 529: "overloaded_error"}.get(status, "api_error")
            return self._error(status, kind, f"stand-in refused the request ({status})")
        if mode == "slow":
            await asyncio.sleep(self.slow_s)
        mid, model = f"msg_{uuid.uuid4().hex[:16]}", body.get("model")
        tool = mode == "tool"
        tool_input = {"command": "pytest -q", "description": "run the tests"}
        usage = {"input_tokens": 200 + len(_last_user_text(body.get("messages") or [])), "output_tokens": 11}
        if not body.get("stream"):
            content = ([{"type": "tool_use", "id": "toolu_sa1", "name": self.tool_name(body), "input": tool_input}]
                       if tool else [{"type": "text", "text": ANSWER}])
            return Response(orjson.dumps({
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None, "usage": usage}),
                media_type="application/json")

        def event(name: str, data: dict[str, Any]) -> bytes:
            return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            yield event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": usage["input_tokens"],
                                                                     "output_tokens": 1}}})
            if tool:
                yield event("content_block_start", {"index": 0, "content_block": {
                    "type": "tool_use", "id": "toolu_sa1", "name": self.tool_name(body), "input": {}}})
                raw = orjson.dumps(tool_input).decode()
                for piece in (raw[:12], raw[12:]):
                    yield event("content_block_delta", {"index": 0, "delta": {"type": "input_json_delta",
                                                                              "partial_json": piece}})
            else:
                yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                for i, word in enumerate(ANSWER.split(" ")):
                    yield event("content_block_delta", {"index": 0, "delta": {
                        "type": "text_delta", "text": word if i == 0 else " " + word}})
                    if mode == "break" and i == 1:
                        raise BrokenStream("stand-in dropped the stream")
            yield event("content_block_stop", {"index": 0})
            yield event("message_delta", {"delta": {"stop_reason": "tool_use" if tool else "end_turn",
                                                    "stop_sequence": None},
                                          "usage": {"output_tokens": usage["output_tokens"]}})
            yield event("message_stop", {})

        return StreamingResponse(events(), media_type="text/event-stream")

    @staticmethod
    def _error(status: int, kind: str, message: str) -> Response:
        return Response(orjson.dumps({"type": "error", "error": {"type": kind, "message": message}}),
                        status_code=status, media_type="application/json")


def start_openai(api_key: str) -> OpenAIStandIn:
    s = OpenAIStandIn(api_key)
    return s.start(s.app())  # type: ignore[return-value]


def start_anthropic(api_key: str) -> AnthropicStandIn:
    s = AnthropicStandIn(api_key)
    return s.start(s.app())  # type: ignore[return-value]
