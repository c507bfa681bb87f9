"""`POST /v1/messages` (Anthropic Messages) and `POST /v1/messages/count_tokens`.

The request is translated to chat completions (`proxy.translate.anthropic`), sent to vLLM with
`return_token_ids` and `logprobs`, captured from vLLM's raw chunks exactly like a chat call, and the
answer translated back (one `message` object, or the Anthropic event stream). The step keeps the
client's own shape: the Anthropic `messages` as the observation, the `message` as the action output.

The relay helpers here (`open_translated`, `read_completion`, `relay`) are shared with the
Responses door: both translate the same chat completions stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from proxy import calls
from proxy.calls import Call
from proxy.capture import ToolResultIn, sampling_params
from proxy.chat import iter_sse, upstream_error
from proxy.errors import ApiError
from proxy.translate import TranslationError
from proxy.translate.anthropic import (
    MessagesStream,
    chat_to_message,
    count_tokens_chat_body,
    messages_to_chat,
)

# What the proxy adds to every upstream request, for capture (the translators never ask for them).
CAPTURE_FIELDS = {"return_token_ids": True, "logprobs": True}


# --- shared by the translated doors --------------------------------------------------------------


class Translator(Protocol):
    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...


def translation_error(e: TranslationError) -> ApiError:
    return ApiError(e.status, e.message)


async def open_translated(call: Call, upstream_body: dict[str, Any]) -> httpx.Response:
    """Send the translated request; an upstream failure is recorded and raised as an ApiError, which
    the app renders in the door's own error shape (Anthropic or OpenAI), not vLLM's."""
    try:
        resp = await calls.open_upstream(call, {**upstream_body, **CAPTURE_FIELDS})
    except ApiError as e:
        calls.finish(call, status="error", error={"type": "upstream_unavailable", "message": e.message,
                                                  "status_code": e.status})
        e.headers = {**e.headers, **call.response_headers()}
        raise
    if resp.status_code >= 400:
        data = await resp.aread()
        upstream_url = call.upstream_url
        await calls.close_upstream(call, resp)
        error = upstream_error(resp.status_code, data)
        calls.finish(call, status="error", error=error, upstream=upstream_url)
        raise ApiError(resp.status_code, error["message"], headers=call.response_headers())
    return resp


async def read_completion(call: Call, resp: httpx.Response) -> dict[str, Any]:
    """Read a non-streamed chat completion and feed it to the capture (upstream released)."""
    try:
        data = await resp.aread()
    except httpx.HTTPError as e:
        await calls.close_upstream(call, resp)
        calls.finish(call, status="error", error={"type": "upstream_error", "message": f"upstream read failed: {e}"})
        raise ApiError(502, f"upstream read failed: {type(e).__name__}", headers=call.response_headers()) from None
    await calls.close_upstream(call, resp)
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        calls.finish(call, status="error", error={"type": "upstream_error", "message": "upstream sent invalid JSON"})
        raise ApiError(502, "upstream sent invalid JSON", headers=call.response_headers()) from None
    call.mark_token()
    call.capture.feed_response(parsed)
    return parsed


async def relay(call: Call, resp: httpx.Response, translator: Translator, fail: Callable[[str], list[bytes]],
                done: Callable[[str, dict[str, Any] | None], None]) -> AsyncIterator[bytes]:
    """vLLM's chat chunks -> capture (raw) and translator (client events); `done(status, error)` once.

    `done` runs however the stream ends: completed ("ok"), upstream error ("error"), or the client
    leaving mid-stream ("aborted", the generator is closed at its pending `yield`).
    """
    status, error = "aborted", {"type": "client_disconnected", "message": "the client went away mid-stream"}
    try:
        async for payload in iter_sse(resp):
            if payload == b"[DONE]":
                continue
            chunk = orjson.loads(payload)
            if chunk.get("error") or chunk.get("object") == "error":  # vLLM's mid-stream failure
                err = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
                status, error = "error", {"type": "upstream_error", "message": str(err.get("message") or err)}
                yield b"".join(translator.feed(chunk))  # the translator answers with its error event
                break
            call.capture.feed_chunk(chunk)
            if call.ttft_s is None and call.capture.output_token_ids:
                call.mark_token()
            events = translator.feed(chunk)
            if events:
                yield b"".join(events)
        else:
            status, error = "ok", None
            yield b"".join(translator.finish())
    except httpx.HTTPError as e:
        status, error = "error", {"type": "upstream_error", "message": f"upstream stream broke: {type(e).__name__}"}
        yield b"".join(fail(error["message"]))
    finally:
        try:
            done(status, error)
        finally:
            await calls.close_upstream(call, resp)


# --- the Messages door ---------------------------------------------------------------------------


def _tool_results(messages: list[Any]) -> list[ToolResultIn]:
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), list):
            for block in m["content"]:
                if isinstance(block, dict) and block.get("type") == "tool_result" and block.get("tool_use_id"):
                    out.append(ToolResultIn(call_id=block["tool_use_id"], content=block,
                                            is_error=bool(block.get("is_error"))))
    return out


def message_id(call: Call) -> str:
    return "msg_" + call.step_id.replace("-", "")


def echo_units(message: dict[str, Any]) -> list[dict[str, Any]]:
    """What an Anthropic client sends back next turn for this answer: one assistant message."""
    return [{"role": "assistant", "content": message["content"]}]


async def handle(request: Request, body: Any, call_begin) -> Response:
    try:
        req = messages_to_chat(body)
    except TranslationError as e:
        raise translation_error(e) from None
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "model: Field required")
    call: Call = call_begin(
        "messages", body, body["messages"], system=body.get("system"), tools=body.get("tools"),
        tool_results_of=_tool_results, params=sampling_params(body),
    )
    resp = await open_translated(call, req.body)
    model, mid = body["model"], message_id(call)
    if body.get("stream"):
        stream = MessagesStream(model=model, message_id=mid, tool_names=req.tool_names)
        upstream_url = call.upstream_url

        def done(status: str, error: dict[str, Any] | None) -> None:
            message = stream.message
            calls.finish(call, status=status, error=error, native_output=message, output_units=echo_units(message),
                         tool_names=req.tool_names, upstream=upstream_url)

        body_iter = relay(call, resp, stream, lambda msg: stream.error("api_error", msg), done)
        return calls.GuardedStream(call, resp, body_iter)
    upstream_url = call.upstream_url
    parsed = await read_completion(call, resp)
    message = chat_to_message(parsed, model=model, message_id=mid, tool_names=req.tool_names)
    calls.finish(call, status="ok", native_output=message, output_units=echo_units(message),
                 tool_names=req.tool_names, upstream=upstream_url)
    return Response(orjson.dumps(message), media_type="application/json", headers=call.response_headers())


# --- count_tokens --------------------------------------------------------------------------------


def count_tokens_handler(state):
    async def count_tokens(request: Request, body: Any, call_begin) -> Response:
        """The prompt's real token count: vLLM renders the translated chat request with the model's
        own chat template (`POST /tokenize`), the same ids a `/v1/messages` call would be given."""
        try:
            chat = count_tokens_chat_body(body)
        except TranslationError as e:
            raise translation_error(e) from None
        if not isinstance(chat.get("model"), str):
            raise ApiError(400, "model: Field required")
        content = orjson.dumps(chat)
        headers = {"content-type": "application/json"}
        if state.settings_upstream_key:
            headers["authorization"] = f"Bearer {state.settings_upstream_key}"
        last = "no replica answered"
        for replica in state.pool.candidates(request.headers.get("x-atdp-session-id") or "count_tokens"):
            try:
                resp = await state.client.post(replica.url + "/tokenize", content=content, headers=headers)
            except httpx.HTTPError as e:
                last = f"{replica.url}: {type(e).__name__}"
                continue
            if resp.status_code >= 500:
                last = f"{replica.url} answered {resp.status_code}"
                continue
            if resp.status_code >= 400:
                raise ApiError(resp.status_code, upstream_error(resp.status_code, resp.content)["message"])
            return Response(orjson.dumps({"input_tokens": int(resp.json()["count"])}), media_type="application/json")
        raise ApiError(502, f"upstream unavailable: {last}")

    return count_tokens


def install(app, state) -> None:
    from proxy.app import door

    messages_endpoint = door(state, "anthropic", handle)
    count_endpoint = door(state, "anthropic", count_tokens_handler(state))
    for prefix in ("", "/s/{session_id}"):
        app.add_api_route(prefix + "/v1/messages", messages_endpoint, methods=["POST"])
        app.add_api_route(prefix + "/v1/messages/count_tokens", count_endpoint, methods=["POST"])
