"""Chat completions -> OpenAI Responses: one `response` object (`chat_to_response`) or the event
stream (`ResponsesStream`). The request side is `proxy.translate.responses`.

Reasoning (when vLLM runs a reasoning parser) becomes a `reasoning` item, content a `message` item
with one `output_text` part, each tool call a `function_call` item (a namespace tool's call comes
back as its inner name plus `namespace`). Item ids derive from the response id: `msg_<rid>_<n>`,
`fc_<rid>_<n>`, `rs_<rid>_<n>` with n the output index.
"""

from __future__ import annotations

import time
from typing import Any

from proxy.translate._chat import TextBuffer, first_choice, reasoning_text, usage_counts
from proxy.translate.chunks import Chunk, read_chunk
from proxy.translate.sse import encode_event


def _item_id(prefix: str, response_id: str, output_index: int) -> str:
    return f"{prefix}_{response_id.removeprefix('resp_')}_{output_index}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(
    item_id: str, call_id: str, upstream_name: str, arguments: str, status: str, tool_names: dict[str, Any]
) -> dict[str, Any]:
    namespace, name = tool_names.get(upstream_name, (None, upstream_name))
    item: dict[str, Any] = {
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


def response_usage(
    input_tokens: int | None, output_tokens: int | None, cached_tokens: int = 0
) -> dict[str, Any]:
    input_tokens, output_tokens = input_tokens or 0, output_tokens or 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    *,
    response_id: str,
    model: str,
    request: dict[str, Any],
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Responses `response` object echoing the request's parameters, as OpenAI returns it."""
    reasoning = request.get("reasoning") if isinstance(request.get("reasoning"), dict) else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": bool(request.get("background", False)),
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "model": model,
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "prompt_cache_key": request.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": "default",
        "store": request.get("store", True),
        "temperature": request.get("temperature", 1.0),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p", 1.0),
        "truncation": request.get("truncation", "disabled"),
        "usage": usage,
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def chat_to_response(
    chat_resp: dict[str, Any],
    *,
    model: str,
    response_id: str,
    request: dict[str, Any],
    tool_names: dict[str, Any],
    created_at: int | None = None,
) -> dict[str, Any]:
    """Translate a (non-streamed) chat completion into a Responses `response` object."""
    choice = first_choice(chat_resp) or {}
    message = choice.get("message") or {}
    incomplete = choice.get("finish_reason") == "length"
    output: list[dict[str, Any]] = []
    reasoning = reasoning_text(message)
    if reasoning:
        output.append(_reasoning_item(_item_id("rs", response_id, len(output)), reasoning))
    if message.get("content"):
        output.append(
            {
                "id": _item_id("msg", response_id, len(output)),
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [_text_part(message["content"])],
            }
        )
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        item_id = _item_id("fc", response_id, len(output))
        arguments = function.get("arguments") or ""
        output.append(
            _call_item(
                item_id, call.get("id") or "", function.get("name") or "", arguments, "completed", tool_names
            )
        )
    if incomplete and output:
        output[-1]["status"] = "incomplete"
    prompt_tokens, completion_tokens, cached = usage_counts(chat_resp.get("usage"))
    return response_object(
        response_id=response_id,
        model=model,
        request=request,
        created_at=created_at if created_at is not None else int(chat_resp.get("created") or time.time()),
        status="incomplete" if incomplete else "completed",
        output=output,
        usage=response_usage(prompt_tokens, completion_tokens, cached),
    )


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


class ResponsesStream:
    """Chat completion chunks in, Responses SSE events out (the sequence Codex and the SDK accept).

    `start()` emits `response.created` and `response.in_progress`; `feed()` opens an output item
    when a new kind of output begins (reasoning, text, or a new tool call index) and closes the
    previous one; `finish()` closes the last item and emits `response.completed` (or
    `response.incomplete` when the length limit cut the answer); `error()` emits `response.failed`.
    Every event carries `type` and a `sequence_number` counting from 0.
    """

    def __init__(
        self,
        *,
        model: str,
        response_id: str,
        request: dict[str, Any],
        tool_names: dict[str, Any],
        created_at: int | None = None,
    ) -> None:
        self.model = model
        self.response_id = response_id
        self.request = request
        self.tool_names = tool_names
        self.created_at = created_at if created_at is not None else int(time.time())
        self.started = False
        self.done = False
        self.status = "in_progress"
        self._items: list[dict[str, Any]] = []  # item skeletons; their text grows in `_texts`
        self._texts: list[TextBuffer] = []  # message text, reasoning text or arguments, per item
        self._sequence = 0
        self._open: int | None = None  # output index of the open item
        self._tool_items: dict[int, int] = {}  # chat tool call index -> output index
        self._input_tokens: int | None = None
        self._output_tokens: int | None = None
        self._cached_tokens = 0
        self._generated_ids = 0
        self._finish_reason: str | None = None
        self._error: dict[str, Any] | None = None

    @property
    def response(self) -> dict[str, Any]:
        """The response object as it stands (final after `finish()` or `error()`)."""
        usage = None
        if self.status != "in_progress":
            usage = response_usage(self._input_tokens, self._output_count(), self._cached_tokens)
        return response_object(
            response_id=self.response_id,
            model=self.model,
            request=self.request,
            created_at=self.created_at,
            status=self.status,
            output=self.output_items,
            usage=usage,
            error=self._error,
        )

    @property
    def output_items(self) -> list[dict[str, Any]]:
        """The output items so far (what the caller stores for `previous_response_id`)."""
        return [self._item(index) for index in range(len(self._items))]

    def start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [
            self._emit("response.created", response=self.response),
            self._emit("response.in_progress", response=self.response),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        return self.feed_part(read_chunk(chunk))

    def feed_part(self, part: Chunk) -> list[bytes]:
        """The events for one chunk, as `read_chunk` read it (the capture reads the same)."""
        if self.done:
            return []
        events = self.start()
        if part.error is not None:
            return events + self.error(part.error)
        if self._input_tokens is None and part.prompt_token_ids is not None:
            self._input_tokens = len(part.prompt_token_ids)  # until the usage chunk says it
        prompt_tokens, completion_tokens, cached = usage_counts(part.usage)
        if prompt_tokens is not None:
            self._input_tokens, self._cached_tokens = prompt_tokens, cached
        if completion_tokens is not None:
            self._output_tokens = completion_tokens
        if not part.has_choice:
            return events
        self._generated_ids += len(part.token_ids)
        if part.reasoning:
            events += self._reasoning_delta(part.reasoning)
        if part.content:
            events += self._text_delta(part.content)
        for call in part.tool_calls:
            events += self._tool_delta(call)
        if part.finish_reason:
            self._finish_reason = part.finish_reason
        return events

    def finish(self) -> list[bytes]:
        if self.done:
            return []
        events = self.start()
        incomplete = self._finish_reason == "length"
        events += self._close("incomplete" if incomplete else "completed")
        self.done = True
        self.status = "incomplete" if incomplete else "completed"
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self._emit(kind, response=self.response))
        return events

    def error(self, message: str, code: str = "server_error") -> list[bytes]:
        """`response.failed` with the error; Codex reads `response.error.code` / `.message` from it."""
        if self.done:
            return []
        events = self.start()
        self.done = True
        self.status = "failed"
        self._error = {"code": code, "message": message}
        events.append(self._emit("response.failed", response=self.response))
        return events

    # -- internals --

    def _output_count(self) -> int:
        return self._output_tokens if self._output_tokens is not None else self._generated_ids

    def _emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return encode_event(kind, payload)

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close("completed")
        index = len(self._items)
        self._items.append(item)
        self._texts.append(TextBuffer())
        self._open = index
        events.append(self._emit("response.output_item.added", output_index=index, item=self._item(index)))
        return events

    def _close(self, status: str) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        self._items[index]["status"] = status
        item = self._item(index)
        events: list[bytes] = []
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._emit(
                    "response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[]
                )
            )
            events.append(self._emit("response.content_part.done", **ids, content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(
                self._emit("response.reasoning_text.done", **ids, content_index=0, text=part["text"])
            )
            events.append(self._emit("response.content_part.done", **ids, content_index=0, part=dict(part)))
        elif item["type"] == "function_call":
            events.append(
                self._emit("response.function_call_arguments.done", **ids, arguments=item["arguments"])
            )
        events.append(self._emit("response.output_item.done", output_index=index, item=item))
        return events

    def _item(self, index: int) -> dict[str, Any]:
        """A copy of item `index` with its text filled in."""
        item = dict(self._items[index])
        text = self._texts[index].text()
        if item["type"] == "function_call":
            item["arguments"] = text
        elif item.get("content"):
            item["content"] = [{**item["content"][0], "text": text}]
        return item

    def _text_delta(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._items[self._open]["type"] != "message":
            item_id = _item_id("msg", self.response_id, len(self._items))
            item = {
                "id": item_id,
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            events += self._open_item(item)
            item["content"] = [_text_part("")]
            ids = {"item_id": item_id, "output_index": self._open}
            events.append(
                self._emit("response.content_part.added", **ids, content_index=0, part=_text_part(""))
            )
        return events + self._append(
            self._open, "response.output_text.delta", text, content_index=0, logprobs=[]
        )

    def _reasoning_delta(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._items[self._open]["type"] != "reasoning":
            item_id = _item_id("rs", self.response_id, len(self._items))
            item = {"id": item_id, "type": "reasoning", "summary": [], "content": []}
            events += self._open_item(item)
            part = {"type": "reasoning_text", "text": ""}
            item["content"] = [part]
            ids = {"item_id": item_id, "output_index": self._open}
            events.append(self._emit("response.content_part.added", **ids, content_index=0, part=dict(part)))
        return events + self._append(self._open, "response.reasoning_text.delta", text, content_index=0)

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        function = call.get("function") or {}
        tool_index = call.get("index", 0)
        index = self._tool_items.get(tool_index)
        if index is None:
            item_id = _item_id("fc", self.response_id, len(self._items))
            name = function.get("name") or ""
            events += self._open_item(
                _call_item(item_id, call.get("id") or "", name, "", "in_progress", self.tool_names)
            )
            index = self._tool_items[tool_index] = len(self._items) - 1
        fragment = function.get("arguments") or ""
        if not fragment:
            return events
        if index != self._open:
            # vLLM sends tool calls one after the other; a late fragment for a closed item cannot be
            # streamed any more, but it is kept in the item (and so in `.response`).
            self._texts[index].append(fragment)
            return events
        return events + self._append(index, "response.function_call_arguments.delta", fragment)

    def _append(self, index: int | None, kind: str, delta: str, **fields: Any) -> list[bytes]:
        assert index is not None
        self._texts[index].append(delta)
        ids = {"item_id": self._items[index]["id"], "output_index": index}
        return [self._emit(kind, **ids, **fields, delta=delta)]
