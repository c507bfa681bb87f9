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

The response side (`chat_to_response`, `ResponsesStream`) is `proxy.translate.responses_stream`; a
call of a namespace tool comes back as `name` = the inner function name plus `namespace` = NS, which
is how Codex routes it (a flattened name is rejected as "unsupported call").
"""

from __future__ import annotations

from typing import Any

from proxy.translate import ChatRequest, TranslationError
from proxy.translate._chat import text_of

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


