"""`POST /v1/messages` (Anthropic Messages) and `POST /v1/messages/count_tokens`.

The request is translated to chat completions (`proxy.translate.anthropic`), sent to vLLM with
`return_token_ids` and `logprobs`, captured from vLLM's raw chunks exactly like a chat call, and the
answer translated back (one `message` object, or the Anthropic event stream). The step keeps the
client's own shape: the Anthropic `messages` as the observation, the `message` as the action output.

The relay helpers (`open_translated`, `read_completion`, `relay`) live in `proxy.call`: the Responses
door translates the same chat completions stream.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from proxy import call as calls
from proxy import providers
from proxy.call import Call, open_translated, read_completion, translation_error
from proxy.engine import EngineUnreachable
from proxy.errors import ApiError
from proxy.http import CallBegin, Handler, Route, check_body, door, json_response, model_routes
from proxy.record.capture import ToolResultIn, sampling_params
from proxy.shapes import CountTokensRequest, MessagesRequest
from proxy.state import AppState
from proxy.streams import GuardedStream, relay
from proxy.translate import TranslationError
from proxy.translate.anthropic import count_tokens_chat_body, messages_to_chat
from proxy.translate.anthropic_stream import MessagesStream, chat_to_message
from proxy.upstream import Replica, ReplicaFailed, failover, upstream_error

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


async def handle(request: Request, body: Any, call_begin: CallBegin) -> Response:
    check_body(MessagesRequest, body, request)
    try:
        req = messages_to_chat(body)
    except TranslationError as e:
        raise translation_error(e) from None
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "model: Field required")
    call: Call = await call_begin(
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
        return GuardedStream(call, resp, body_iter)
    upstream_url = call.upstream_url
    parsed = await read_completion(call, resp)
    message = chat_to_message(parsed, model=model, message_id=mid, tool_names=req.tool_names)
    calls.finish(call, status="ok", native_output=message, output_units=echo_units(message),
                 tool_names=req.tool_names, upstream=upstream_url)
    await calls.settle(call)
    return Response(orjson.dumps(message), media_type="application/json", headers=call.response_headers())


# --- count_tokens --------------------------------------------------------------------------------


def count_tokens_handler(state: AppState) -> Handler:
    async def count_tokens(request: Request, body: Any, call_begin: CallBegin) -> Response:
        """The prompt's real token count: vLLM renders the translated chat request with the model's
        own chat template (`POST /tokenize`), the same ids a `/v1/messages` call would be given.
        A provider route's model is counted by its provider (or LiteLLM's local tokenizer)."""
        check_body(CountTokensRequest, body, request)
        try:
            chat = count_tokens_chat_body(body)
        except TranslationError as e:
            raise translation_error(e) from None
        if not isinstance(chat.get("model"), str):
            raise ApiError(400, "model: Field required")
        route = state.routes.match(chat["model"])
        if route is not None:  # a provider model: its own count (proxy.providers), not vLLM's tokenizer
            return json_response({"input_tokens": await providers.count_tokens(route, chat)})
        content = orjson.dumps(chat)
        engine = state.engine_client
        assert engine is not None, "the app is not started"

        async def attempt(replica: Replica) -> Response:
            try:
                resp = await engine.tokenize(replica.url, content)
            except EngineUnreachable as e:
                raise ReplicaFailed(f"{replica.label}: {e.kind}") from None
            if resp.status >= 500:
                raise ReplicaFailed(f"{replica.label} answered {resp.status}")
            if resp.status >= 400:
                raise ApiError(resp.status, upstream_error(resp.status, resp.body)["message"])
            return json_response({"input_tokens": int(resp.json()["count"])})

        return await failover(state.pool, request.headers.get("x-atdp-session-id") or "count_tokens", attempt)

    return count_tokens


def routes(state: AppState) -> list[Route]:
    return (model_routes("/v1/messages", door(state, handle))
            + model_routes("/v1/messages/count_tokens", door(state, count_tokens_handler(state))))
