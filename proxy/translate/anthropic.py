"""Anthropic Messages <-> OpenAI chat completions.

Request (`messages_to_chat`):

| Messages                                   | chat completions                                      |
| ------------------------------------------ | ----------------------------------------------------- |
| `system` string / text blocks              | leading `system` message (blocks joined with "\\n")    |
| `role:"system"` message inside `messages`  | `system` message at that position                     |
| `text` blocks                              | string content (several joined with "\\n")             |
| `image` block (base64 / url)               | `image_url` part (a `data:` URL for base64)           |
| assistant `tool_use`                       | `tool_calls` entry, arguments as a JSON string        |
| user `tool_result`                         | `role:"tool"` message, before the user's own text     |
| `tool_result` with `is_error`              | content prefixed with "Error: "                       |
| `thinking` / `redacted_thinking` blocks    | dropped (not part of the upstream prompt)             |
| final assistant message (prefill)          | `continue_final_message`, no generation prompt        |
| `tools[]` (`input_schema`)                 | function tools (`parameters`); server tools dropped   |
| `tool_choice` auto / any / tool / none     | `auto` / `required` / named function / `none`         |
| `disable_parallel_tool_use`                | `parallel_tool_calls: false`                          |
| `stop_sequences`                           | `stop`                                                |
| `stream`                                   | `stream` + `stream_options.include_usage`             |

The response side (`chat_to_message`, `MessagesStream`) is `proxy.translate.anthropic_stream`. A tool
input kept there as `{"_raw": "<text>"}` is sent upstream again as the raw text, so the round trip is
exact.
"""

from __future__ import annotations

from typing import Any

from proxy.translate import ChatRequest, TranslationError
from proxy.translate._chat import (
    dumps_arguments,
)

# Accepted and ignored: they tune Anthropic-side features the upstream does not have.
IGNORED_FIELDS = frozenset(
    {
        "thinking",
        "output_config",
        "context_management",
        "metadata",
        "cache_control",
        "service_tier",
        "container",
        "mcp_servers",
        "betas",
        "anthropic_version",
        "inference_geo",
        "speed",
    }
)

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}

_ROLES = ("user", "assistant", "system")
RAW_ARGUMENTS_KEY = "_raw"


# -- request ------------------------------------------------------------------------------------


def messages_to_chat(body: dict[str, Any]) -> ChatRequest:
    """Translate a `/v1/messages` request body into a chat completions request."""
    return _translate(body, for_counting=False)


def count_tokens_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request to render for `/v1/messages/count_tokens` (no `max_tokens` needed)."""
    chat = _translate(body, for_counting=True).body
    keep = ("model", "messages", "tools")
    return {key: chat[key] for key in keep if key in chat}


def _translate(body: Any, *, for_counting: bool) -> ChatRequest:
    if not isinstance(body, dict):
        raise TranslationError(400, "request body must be a JSON object")
    messages = body.get("messages")
    if messages is None:
        raise TranslationError(400, "messages: Field required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise TranslationError(400, "messages: must be a non-empty list", param="messages")
    max_tokens = body.get("max_tokens")
    if not for_counting:
        if max_tokens is None:
            raise TranslationError(400, "max_tokens: Field required", param="max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise TranslationError(400, "max_tokens: must be a positive integer", param="max_tokens")

    warnings: list[str] = []
    chat_messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _system_text(system, "system")
        if text:
            chat_messages.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        chat_messages.extend(_message(message, i, warnings))

    chat: dict[str, Any] = {}
    if "model" in body:
        chat["model"] = body["model"]
    chat["messages"] = chat_messages

    tools, tool_names = _tools(body.get("tools"), warnings)
    if tools:
        chat["tools"] = tools
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        _tool_choice(tool_choice, chat)

    last = chat_messages[-1]
    if messages[-1].get("role") == "assistant" and last["content"] and not last.get("tool_calls"):
        # Prefill: the model continues the given assistant text instead of starting a new turn.
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True

    if max_tokens is not None and not for_counting:
        chat["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stop = body.get("stop_sequences")
    if stop:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise TranslationError(400, "stop_sequences: must be a list of strings", param="stop_sequences")
        chat["stop"] = list(stop)
    if body.get("stream") and not for_counting:
        chat["stream"] = True
        # The final usage chunk gives message_delta its output token count.
        chat["stream_options"] = {"include_usage": True}

    handled = {"model", "messages", "system", "max_tokens", "tools", "tool_choice", "temperature"}
    handled |= {"top_p", "top_k", "stop_sequences", "stream"}
    for name in body:
        if name not in handled:
            warnings.append(f"{'ignored' if name in IGNORED_FIELDS else 'unknown'} field: {name}")
    return ChatRequest(body=chat, tool_names=tool_names, warnings=warnings)


def _system_text(system: Any, where: str) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        texts = []
        for block in system:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise TranslationError(400, f"{where}: only text blocks are allowed", param=where)
            texts.append(block.get("text", ""))  # cache_control is ignored
        return "\n".join(texts)
    raise TranslationError(400, f"{where}: must be a string or a list of text blocks", param=where)


def _message(message: Any, i: int, warnings: list[str]) -> list[dict[str, Any]]:
    where = f"messages.{i}"
    if not isinstance(message, dict):
        raise TranslationError(400, f"{where}: must be an object", param=where)
    role = message.get("role")
    if role not in _ROLES:
        raise TranslationError(
            400, f"{where}.role: must be one of 'user', 'assistant'", param=f"{where}.role"
        )
    if "content" not in message:
        raise TranslationError(400, f"{where}.content: Field required", param=f"{where}.content")
    content = message["content"]
    if role == "system":
        return [{"role": "system", "content": _system_text(content, f"{where}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise TranslationError(400, f"{where}.content: must be a string or a list of blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise TranslationError(400, f"{where}.content.{j}: must be a block with a type")
    if role == "assistant":
        return [_assistant(content, where, warnings)]
    return _user(content, where, warnings)


def _assistant(blocks: list[dict[str, Any]], where: str, warnings: list[str]) -> dict[str, Any]:
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": _arguments(block.get("input"))},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # reasoning of earlier turns is not replayed to the model
        else:
            warnings.append(f"dropped block: {where} {kind}")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _arguments(value: Any) -> str:
    if (
        isinstance(value, dict)
        and set(value) == {RAW_ARGUMENTS_KEY}
        and isinstance(value[RAW_ARGUMENTS_KEY], str)
    ):
        return value[RAW_ARGUMENTS_KEY]
    return dumps_arguments({} if value is None else value)


def _user(blocks: list[dict[str, Any]], where: str, warnings: list[str]) -> list[dict[str, Any]]:
    # Tool results answer the preceding assistant turn, so they come first; the user's own
    # text and images in the same message follow them.
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append(_image(block, where))
        elif kind == "tool_result":
            text, images = _tool_result(block, where, warnings)
            tool_messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            if images:
                warnings.append(f"moved tool_result images to the user message: {where}")
                parts.extend(images)
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            warnings.append(f"dropped block: {where} {kind}")
    messages = list(tool_messages)
    if parts or not tool_messages:
        messages.append({"role": "user", "content": _parts_content(parts)})
    return messages


def _parts_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = source.get("url", "")
    else:
        raise TranslationError(400, f"{where}: unsupported image source {source.get('type')!r}")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict[str, Any], where: str, warnings: list[str]) -> tuple[str, list[dict[str, Any]]]:
    content = block.get("content")
    images: list[dict[str, Any]] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(part.get("text", ""))
            elif kind == "image":
                images.append(_image(part, where))
            else:
                warnings.append(f"dropped tool_result block: {where} {kind}")
        text = "\n".join(texts)
    else:
        raise TranslationError(400, f"{where}: tool_result content must be a string or a list of blocks")
    if block.get("is_error"):
        # Chat has no error flag on tool messages; say it in the text the model reads.
        text = f"Error: {text}" if text else "Error"
    return text, images


def _tools(tools: Any, warnings: list[str]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise TranslationError(400, "tools: must be a list", param="tools")
    chat_tools: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise TranslationError(400, f"tools.{i}: must be an object with a name", param=f"tools.{i}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            # Server tools (web_search_2025..., bash_2025..., text_editor...) run at Anthropic.
            warnings.append(f"dropped tool: {tool['name']} ({kind})")
            continue
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        chat_tools.append({"type": "function", "function": function})
        names[tool["name"]] = tool["name"]
    return chat_tools, names


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise TranslationError(
            400, "tool_choice: must be auto, any, tool (with a name) or none", param="tool_choice"
        )
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


