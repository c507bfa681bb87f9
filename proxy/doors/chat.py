"""`POST /v1/chat/completions`: forwarded to vLLM as is, captured token-exact.

The proxy asks vLLM for `return_token_ids` and `logprobs` on every call and removes them from the
answer unless the client asked for them, so the client sees what vLLM would have sent it. Streams
pass through chunk by chunk as they arrive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from atdp_schema.models import StepStatus
from proxy import call as calls
from proxy.call import Answer, Call
from proxy.engine import UpstreamError
from proxy.errors import ApiError, error_body
from proxy.http import CallBegin, Route, check_body, door, model_routes
from proxy.record.capture import ToolResultIn, sampling_params
from proxy.shapes import ChatCompletionRequest
from proxy.state import AppState
from proxy.streams import GuardedStream, Last, close_engine_part
from proxy.translate.sse import DONE, encode_data, iter_sse_batches
from proxy.upstream import upstream_error


def _tool_results(messages: list[Any]) -> list[ToolResultIn]:
    return [
        ToolResultIn(call_id=m["tool_call_id"], content=m)
        for m in messages
        if isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id")
    ]


def _system(messages: list[Any]) -> Any:
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        return first  # the same object as the message: stored once
    return None


def validate(request: Request, body: Any) -> None:
    """The body's shape (types, ids: `proxy.shapes.ChatCompletionRequest`), before anything else."""
    check_body(ChatCompletionRequest, body, request)
    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "atdp records one choice per call: use n=1 (send parallel calls for several samples)",
                       param="n")


class ChatShaper:
    """Removes what the proxy added for capture, so the client gets vLLM's answer as it asked for it."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.want_ids = body.get("return_token_ids") is True
        self.want_logprobs = bool(body.get("logprobs"))
        opts = body.get("stream_options") or {}
        self.want_usage = bool(opts.get("include_usage"))

    def upstream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        up = dict(body)
        up["return_token_ids"] = True
        if not self.want_logprobs:
            up["logprobs"] = True
        if body.get("stream"):
            up["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return up

    def shape_choice(self, choice: dict[str, Any]) -> None:
        if not self.want_ids:
            choice.pop("token_ids", None)
        if not self.want_logprobs and "logprobs" in choice:
            choice["logprobs"] = None

    def shape_response(self, resp: dict[str, Any]) -> dict[str, Any]:
        if not self.want_ids:
            resp.pop("prompt_token_ids", None)
        for c in resp.get("choices") or ():
            self.shape_choice(c)
        return resp

    def shape_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """None = drop the chunk (the usage-only chunk the client did not ask for)."""
        if not self.want_usage and "usage" in chunk:
            if not chunk.get("choices"):
                return None
            chunk.pop("usage", None)
        if not self.want_ids:
            chunk.pop("prompt_token_ids", None)
        for c in chunk.get("choices") or ():
            self.shape_choice(c)
        return chunk


async def handle(request: Request, body: Any, call_begin: CallBegin) -> Response:
    """The chat door. `call_begin(api, body, messages, **kw)` resolves session and principal."""
    validate(request, body)
    messages = body["messages"]
    call: Call = await call_begin(
        "chat.completions", body, messages, system=_system(messages), tools=body.get("tools"),
        tool_results_of=_tool_results, params=sampling_params(body),
    )
    shaper = ChatShaper(body)
    upstream_body = shaper.upstream_body(body)
    try:
        resp = await calls.open_upstream(call, upstream_body)
    except ApiError as e:
        calls.finish(call, status="error", error={"type": "upstream_unavailable", "message": e.message, "status_code": e.status})
        e.headers = {**e.headers, **call.response_headers()}  # as every other answer: which session, which step
        raise
    if resp.status_code >= 400:  # vLLM's own error answer, passed through as chat completions clients expect
        upstream_url = call.upstream_url
        try:
            data = await resp.aread()
        except UpstreamError as e:  # the error body broke mid-read: a 502 of our own
            calls.finish(call, status="error", error={"type": "upstream_error", "message": e.message},
                         upstream=upstream_url)
            e.headers = {**e.headers, **call.response_headers()}
            raise
        finally:
            await calls.close_upstream(call, resp)  # the replica's slot, whatever the read did
        calls.finish(call, status="error", error=upstream_error(resp.status_code, data), upstream=upstream_url)
        return Response(data, status_code=resp.status_code, media_type=resp.headers.get("content-type", "application/json"),
                        headers=call.response_headers())
    if body.get("stream"):
        return GuardedStream(call, resp, _stream(call, resp, shaper))
    parsed = await calls.read_completion(call, resp)
    msg = ((parsed.get("choices") or [{}])[0]).get("message")
    calls.finish(call, status="ok", native_output=msg)
    await calls.settle(call)
    return Response(orjson.dumps(shaper.shape_response(parsed)), media_type="application/json",
                    headers=call.response_headers())


async def _stream(call: Call, resp: Answer, shaper: ChatShaper) -> AsyncIterator[bytes]:
    status, error = StepStatus.aborted, {"type": "client_disconnected", "message": "the client went away mid-stream"}
    upstream_url = call.upstream_url
    capture = call.capture
    try:
        batches = iter_sse_batches(resp.aiter_raw())
        async for batch in batches:
            out = bytearray()
            for payload in batch:
                if payload == b"[DONE]":  # the engine's answer is complete: end the client's stream now
                    await _end(call, status, error, upstream_url)
                    yield Last(bytes(out) + DONE)
                    await close_engine_part(call, batches)
                    return
                chunk = orjson.loads(payload)
                if chunk.get("error"):  # vLLM reports mid-stream failures as an error chunk
                    status, error = "error", {"type": "upstream_error", "message": str(chunk["error"].get("message", chunk["error"]))}
                    out += b"data: " + payload + b"\n\n"
                    continue
                capture.feed_chunk(chunk)
                if call.ttft_s is None and capture.has_output:
                    call.mark_token()
                shaped = shaper.shape_chunk(chunk)
                if shaped is not None:
                    out += b"data: " + orjson.dumps(shaped) + b"\n\n"
            if out:
                yield bytes(out)
        await _end(call, status, error, upstream_url)  # an engine that ended without its [DONE]
        yield Last(DONE)
    except UpstreamError as e:
        status, error = "error", {"type": "upstream_error", "message": e.message}
        yield encode_data(error_body("openai", 502, e.message, type="upstream_error"))
    finally:
        calls.finish(call, status=status, error=error, native_output=capture.assistant_message(), upstream=upstream_url)
        await calls.close_upstream(call, resp)


async def _end(call: Call, status: str, error: dict[str, Any] | None, upstream_url: str | None) -> None:
    """Record the call and publish its continuation keys before the client reads the end of the
    stream, so its next call finds them whichever proxy it reaches."""
    if status == StepStatus.aborted:  # nothing went wrong on the way: the stream completed
        status, error = "ok", None
    calls.finish(call, status=status, error=error, native_output=call.capture.assistant_message(), upstream=upstream_url)
    await calls.settle(call)


def routes(state: AppState) -> list[Route]:
    return model_routes("/v1/chat/completions", door(state, handle))
