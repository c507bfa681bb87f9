"""`POST /v1/responses` (OpenAI Responses).

The request (with the items of `previous_response_id`, if any) is translated to chat completions
(`proxy.translate.responses`), captured from vLLM's raw chunks exactly like a chat call, and the
answer translated back (one `response` object, or the Responses event stream). The step keeps the
client's shape: the input items as the observation, the output items as the action output.

Served responses are kept (unless `store: false`) in `proxy.doors.response_store`, so a later
`previous_response_id` continues the conversation.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from proxy import call as calls
from proxy.call import Call, open_translated, read_completion, translation_error
from proxy.doors.response_store import ResponseStore, Stored
from proxy.errors import ApiError
from proxy.http import CallBegin, Handler, Route, check_body, door, model_routes
from proxy.record.capture import ToolResultIn, sampling_params
from proxy.shapes import ResponsesRequest
from proxy.state import AppState
from proxy.streams import GuardedStream, relay
from proxy.translate import TranslationError
from proxy.translate.responses import responses_to_chat
from proxy.translate.responses_stream import ResponsesStream, chat_to_response


def input_items(body: dict[str, Any]) -> list[Any]:
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


def _tool_results(items: list[Any]) -> list[ToolResultIn]:
    return [
        ToolResultIn(call_id=it["call_id"], content=it)
        for it in items
        if isinstance(it, dict) and it.get("type") in ("function_call_output", "custom_tool_call_output")
        and isinstance(it.get("call_id"), str)
    ]


def dropped_tools(warnings: list[str]) -> list[str]:
    """Names of the tools the upstream cannot run (hosted ones like web_search), from the translator."""
    out = []
    for w in warnings:
        if w.startswith("dropped tool: "):
            name = w.removeprefix("dropped tool: ").rsplit(" (", 1)[0]
            if name not in out:
                out.append(name)
    return out


def response_id(call: Call) -> str:
    return "resp_" + call.step_id.replace("-", "")


def handler(state: AppState, store: ResponseStore) -> Handler:
    async def handle(request: Request, body: Any, call_begin: CallBegin) -> Response:
        check_body(ResponsesRequest, body, request)
        history: list[Any] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            # `door` authenticated already; this is the cached answer (a dict lookup).
            principal = await state.authenticate(request)
            stored = await store.get(principal.tenant, previous)
            if stored is None:
                raise ApiError(404, "Previous response not found (previous_response_id).", param="previous_response_id",
                               type="invalid_request_error", code="previous_response_not_found")
            history = stored.items
        try:
            req = responses_to_chat(body, history=history)
        except TranslationError as e:
            raise translation_error(e) from None
        native = history + input_items(body)
        call: Call = await call_begin(
            "responses", body, native, system=body.get("instructions"), tools=body.get("tools"),
            tool_results_of=_tool_results, params=sampling_params(body),
        )
        extra_headers = {}
        if dropped := dropped_tools(req.warnings):
            extra_headers["x-atdp-dropped-tools"] = ", ".join(dropped)
        resp = await open_translated(call, req.body)
        rid, model, upstream_url = response_id(call), body["model"], call.upstream_url
        keep = body.get("store") is not False

        def record(status: str, error: dict[str, Any] | None, output: list[Any]) -> None:
            calls.finish(call, status=status, error=error, native_output=output, output_units=output,
                         upstream=upstream_url)
            if status == "ok" and keep:
                # By step id: `forget` finds a session's stored responses through its steps.
                store.put(rid, Stored(tenant=call.principal.tenant, step_id=call.step_id, items=native + output,
                                      expires_at=datetime.now(UTC) + timedelta(seconds=store.ttl_s)))

        if body.get("stream"):
            stream = ResponsesStream(model=model, response_id=rid, request=body, tool_names=req.tool_names)
            body_iter = relay(call, resp, stream, stream.error,
                              lambda status, error: record(status, error, stream.output_items))
            return GuardedStream(call, resp, body_iter, headers=extra_headers)
        parsed = await read_completion(call, resp)
        response = chat_to_response(parsed, model=model, response_id=rid, request=body, tool_names=req.tool_names)
        record("ok", None, response["output"])
        await calls.settle(call)
        return Response(orjson.dumps(response), media_type="application/json",
                        headers={**call.response_headers(), **extra_headers})

    return handle


def routes(state: AppState, store: ResponseStore) -> list[Route]:
    return model_routes("/v1/responses", door(state, handler(state, store)))
