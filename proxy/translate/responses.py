"""OpenAI Responses <-> OpenAI chat completions.

Request (`responses_to_chat`):

| Responses                                       | chat completions                                   |
| ----------------------------------------------- | -------------------------------------------------- |
| `instructions`                                  | leading `system` message                           |
| `history` (items of `previous_response_id`)     | messages before those of `input`                   |
| `input` string                                  | one `user` message                                 |
| message item, role `developer` / `system`       | `system` message                                   |
| message item, role `user` / `assistant`         | same role; `*_text` parts joined with "\\n"          |
| `input_image` part                              | `image_url` part                                   |
| `function_call` items (consecutive)             | `tool_calls` of one assistant message (merged into |
|                                                 | the assistant message right before, if any)        |
| `function_call_output` item                     | `role:"tool"` message with `tool_call_id`          |
| `reasoning` items                               | dropped (not part of the upstream prompt)          |
| `function` tool                                 | function tool                                      |
| `namespace` tool `NS` with function `fn`        | function `NS__fn` (`NSfn` when NS ends in `__`)    |
| hosted tools (`web_search`, `file_search`, ...) | dropped, listed in `warnings`                      |
| `tool_choice`, `parallel_tool_calls`            | same (a named function gets its upstream name)     |
| `max_output_tokens`                             | `max_tokens`                                       |
| `text.format` json_schema / json_object         | `response_format`                                  |
| `stream`                                        | `stream` + `stream_options.include_usage`          |

Response (`chat_to_response`, `ResponsesStream`): reasoning (when vLLM runs a reasoning parser)
becomes a `reasoning` item, content a `message` item with one `output_text` part, each tool call a
`function_call` item; a call of a namespace tool comes back as `name` = the inner function name plus
`namespace` = NS, which is how Codex routes it (a flattened name is rejected as "unsupported call").
Item ids derive from the response id: `msg_<rid>_<n>`, `fc_<rid>_<n>`, `rs_<rid>_<n>` with n the
output index, so they are unique and reproducible.
"""

from __future__ import annotations

import time
from typing import Any

from proxy.translate import ChatRequest, TranslationError
from proxy.translate._chat import TextBuffer, first_choice, reasoning_text, text_of, usage_counts
from proxy.translate.sse import encode_event

# Tool types that run on OpenAI's side; a vLLM model cannot call them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
        "custom",
        "tool_search",
    }
)

# Accepted; they tune OpenAI-side features (storage, caching, tracing) or are echoed back only.
ACCEPTED_FIELDS = frozenset(
    {
        "reasoning",
        "store",
        "include",
        "metadata",
        "prompt_cache_key",
        "prompt_cache_retention",
        "client_metadata",
        "previous_response_id",
        "user",
        "safety_identifier",
        "service_tier",
        "truncation",
        "background",
        "stream_options",
    }
)

NAMESPACE_SEPARATOR = "__"
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_DROPPED_ITEMS = ("reasoning", "item_reference", "compaction", "web_search_call", "tool_search_call")


# -- request ------------------------------------------------------------------------------------


def upstream_tool_name(namespace: str | None, name: str) -> str:
    """The chat function name for a (namespace, name) pair."""
    if not namespace:
        return name
    separator = "" if namespace.endswith(NAMESPACE_SEPARATOR) else NAMESPACE_SEPARATOR
    return f"{namespace}{separator}{name}"


def responses_to_chat(body: dict[str, Any], *, history: list[dict[str, Any]] | None = None) -> ChatRequest:
    """Translate a `/v1/responses` request body (plus resolved `previous_response_id` items)."""
    if not isinstance(body, dict):
        raise TranslationError(400, "request body must be a JSON object")
    if "input" not in body and not history:
        raise TranslationError(400, "Missing required parameter: 'input'.", param="input")
    warnings: list[str] = []
    tools, tool_names = _tools(body.get("tools"), warnings)

    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise TranslationError(400, "instructions: must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    if history:
        _items(history, "history", messages, warnings)
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        _items(value, "input", messages, warnings)
    elif value is not None:
        raise TranslationError(400, "input: must be a string or a list of items", param="input")
    if not messages:
        raise TranslationError(400, "input: must not be empty", param="input")

    chat: dict[str, Any] = {}
    if "model" in body:
        chat["model"] = body["model"]
    chat["messages"] = messages
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"], warnings)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = bool(body["parallel_tool_calls"])
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None:
        if (
            not isinstance(max_output_tokens, int)
            or isinstance(max_output_tokens, bool)
            or max_output_tokens < 1
        ):
            raise TranslationError(
                400, "max_output_tokens: must be a positive integer", param="max_output_tokens"
            )
        chat["max_tokens"] = max_output_tokens
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    response_format = _response_format(body.get("text"))
    if response_format:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}

    handled = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls"}
    handled |= {"max_output_tokens", "temperature", "top_p", "text", "stream"}
    for name in body:
        if name not in handled:
            warnings.append(f"{'ignored' if name in ACCEPTED_FIELDS else 'unknown'} field: {name}")
    return ChatRequest(body=chat, tool_names=tool_names, warnings=warnings)


def _items(items: list[Any], where: str, messages: list[dict[str, Any]], warnings: list[str]) -> None:
    for i, item in enumerate(items):
        at = f"{where}.{i}"
        if not isinstance(item, dict):
            raise TranslationError(400, f"{at}: must be an object", param=at)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            messages.append(_message_item(item, at, warnings))
        elif kind in ("function_call", "custom_tool_call"):
            _append_call(messages, item, at)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise TranslationError(400, f"{at}.call_id: Field required", param=f"{at}.call_id")
            output = item.get("output")
            if isinstance(output, list) and any(
                isinstance(p, dict) and p.get("type") not in _TEXT_PARTS for p in output
            ):
                warnings.append(f"dropped non-text tool output parts: {at}")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text_of(output)})
        elif kind in _DROPPED_ITEMS:
            if kind != "reasoning":  # earlier reasoning is dropped on purpose; say so for the rest
                warnings.append(f"dropped item: {at} {kind}")
        else:
            warnings.append(f"dropped item: {at} {kind}")


def _message_item(item: dict[str, Any], at: str, warnings: list[str]) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise TranslationError(
            400,
            f"{at}.role: must be one of 'user', 'assistant', 'system', 'developer'",
            param=f"{at}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise TranslationError(
            400, f"{at}.content: must be a string or a list of parts", param=f"{at}.content"
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            warnings.append(f"dropped content part: {at}.content.{j} {kind}")
    if all(part["type"] == "text" for part in parts):
        return {"role": role, "content": "\n".join(part["text"] for part in parts)}
    return {"role": role, "content": parts}


def _append_call(messages: list[dict[str, Any]], item: dict[str, Any], at: str) -> None:
    if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
        raise TranslationError(400, f"{at}: a function_call needs call_id and name", param=at)
    if item.get("type") == "custom_tool_call":
        arguments = item.get("input") or ""
    else:
        arguments = item.get("arguments") or ""
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": upstream_tool_name(item.get("namespace"), item["name"]), "arguments": arguments},
    }
    # One model turn may be a message item followed by several calls: one assistant message.
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _function(tool: dict[str, Any], name: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if tool.get("description"):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _tools(tools: Any, warnings: list[str]) -> tuple[list[dict[str, Any]], dict[str, tuple[str | None, str]]]:
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise TranslationError(400, "tools: must be a list", param="tools")
    chat_tools: list[dict[str, Any]] = []
    names: dict[str, tuple[str | None, str]] = {}

    def add(tool: dict[str, Any], namespace: str | None, at: str) -> None:
        if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
            tool = {**tool["function"], "type": "function"}  # chat-shaped tool sent to /responses
        if not isinstance(tool.get("name"), str):
            raise TranslationError(400, f"{at}.name: Field required", param=f"{at}.name")
        upstream = upstream_tool_name(namespace, tool["name"])
        if upstream in names:
            warnings.append(f"dropped tool: {upstream} (duplicate name)")
            return
        names[upstream] = (namespace, tool["name"])
        chat_tools.append(_function(tool, upstream))

    for i, tool in enumerate(tools):
        at = f"tools.{i}"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            add(tool, None, at)
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not isinstance(tool.get("tools"), list):
                raise TranslationError(400, f"{at}: a namespace needs a name and tools", param=at)
            for j, inner in enumerate(tool["tools"]):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    add(inner, namespace, f"{at}.tools.{j}")
                else:
                    inner_name = inner.get("name") if isinstance(inner, dict) else None
                    inner_kind = inner.get("type") if isinstance(inner, dict) else None
                    warnings.append(f"dropped tool: {namespace}.{inner_name} ({inner_kind})")
        elif kind is None:
            raise TranslationError(400, f"{at}.type: Field required", param=f"{at}.type")
        else:
            name = tool.get("name") or tool.get("server_label") or kind
            warnings.append(f"dropped tool: {name} ({kind})")
    return chat_tools, names


def _tool_choice(choice: Any, warnings: list[str]) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        name = upstream_tool_name(choice.get("namespace"), choice["name"])
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, dict):
        warnings.append(f"tool_choice {choice.get('type')!r} is not supported upstream; using 'auto'")
        return "auto"
    raise TranslationError(
        400, "tool_choice: must be auto, none, required or a function", param="tool_choice"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema: dict[str, Any] = {"name": fmt.get("name", "response"), "schema": fmt.get("schema", {})}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": schema}
    return None


# -- response -----------------------------------------------------------------------------------


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
        if self.done:
            return []
        events = self.start()
        if chunk.get("object") == "error" or chunk.get("error"):
            error = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
            return events + self.error(str(error.get("message") or "upstream error"))
        prompt_ids = chunk.get("prompt_token_ids")
        if self._input_tokens is None and isinstance(prompt_ids, list):
            self._input_tokens = len(prompt_ids)  # until the usage chunk says it
        prompt_tokens, completion_tokens, cached = usage_counts(chunk.get("usage"))
        if prompt_tokens is not None:
            self._input_tokens, self._cached_tokens = prompt_tokens, cached
        if completion_tokens is not None:
            self._output_tokens = completion_tokens
        choice = first_choice(chunk)
        if choice is None:
            return events
        self._generated_ids += len(choice.get("token_ids") or ())
        delta = choice.get("delta") or {}
        reasoning = reasoning_text(delta)
        if reasoning:
            events += self._reasoning_delta(reasoning)
        if delta.get("content"):
            events += self._text_delta(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._tool_delta(call)
        if choice.get("finish_reason"):
            self._finish_reason = choice["finish_reason"]
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
