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

Response (`chat_to_message`, `MessagesStream`): content becomes a `text` block, `tool_calls` become
`tool_use` blocks (and reasoning, when vLLM runs a reasoning parser, a `thinking` block with an empty
signature). Arguments that are not a JSON object are kept as `{"_raw": "<text>"}` so nothing the model
wrote is lost; such an input is sent upstream again as the raw text, so the round trip is exact.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json

from proxy.translate import ChatRequest, TranslationError
from proxy.translate._chat import (
    TextBuffer,
    dumps_arguments,
    first_choice,
    reasoning_text,
    usage_counts,
)
from proxy.translate.sse import encode_event

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


# -- response -----------------------------------------------------------------------------------


def stop_reason_of(
    finish_reason: str | None, vllm_stop_reason: Any, has_tool_use: bool
) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) from chat's finish_reason and vLLM's stop_reason.

    vLLM's `stop_reason` is the matched stop string (a stop sequence) or a stop token id (an
    ordinary end of turn). A named `tool_choice` ends with "stop" although the model called a tool.
    """
    if finish_reason == "stop" and isinstance(vllm_stop_reason, str):
        return "stop_sequence", vllm_stop_reason
    if finish_reason == "stop" and has_tool_use:
        return "tool_use", None
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def parse_tool_input(arguments: str | None) -> dict[str, Any]:
    """The `input` object of a tool_use block; text that is not a JSON object stays as `{"_raw": text}`."""
    if not arguments or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {RAW_ARGUMENTS_KEY: arguments}
    return value if isinstance(value, dict) else {RAW_ARGUMENTS_KEY: arguments}


def _usage(input_tokens: int | None, output_tokens: int | None) -> dict[str, int]:
    return {
        "input_tokens": input_tokens or 0,
        "output_tokens": output_tokens or 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def chat_to_message(
    chat_resp: dict[str, Any], *, model: str, message_id: str, tool_names: dict[str, str] | None = None
) -> dict[str, Any]:
    """Translate a (non-streamed) chat completion into an Anthropic `message` object."""
    choice = first_choice(chat_resp) or {}
    message = choice.get("message") or {}
    names = tool_names or {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_text(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        name = function.get("name") or ""
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": names.get(name, name),
                "input": parse_tool_input(function.get("arguments")),
            }
        )
    has_tool_use = any(block["type"] == "tool_use" for block in content)
    stop_reason, stop_sequence = stop_reason_of(
        choice.get("finish_reason"), choice.get("stop_reason"), has_tool_use
    )
    prompt_tokens, completion_tokens, _ = usage_counts(chat_resp.get("usage"))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(prompt_tokens, completion_tokens),
    }


class MessagesStream:
    """Chat completion chunks in, Anthropic SSE events out.

    Call `start()` first (or let the first `feed()` do it, taking the input token count from the
    chunk's `prompt_token_ids`), `feed()` every decoded chunk, then `finish()` at the end of the
    upstream stream, or `error()` if it broke. Each returns the encoded events to send. Blocks get
    increasing indices in the order they open: thinking, text, then one per tool call (a new tool
    call index in the chat deltas opens a new block). Argument fragments are sent as they arrive.
    """

    def __init__(self, *, model: str, message_id: str, tool_names: dict[str, str] | None = None) -> None:
        self.model = model
        self.message_id = message_id
        self.tool_names = tool_names or {}
        self.started = False
        self.done = False
        self._pinged = False
        self._blocks: list[dict[str, Any]] = []  # block skeletons; their text grows in `_texts`
        self._texts: list[TextBuffer] = []  # text, thinking or argument text, per block
        self._tool_blocks: dict[int, int] = {}  # chat tool call index -> block index
        self._sent: dict[int, int] = {}  # block index -> characters of arguments sent
        self._broken: set[int] = set()  # blocks whose arguments stopped being a JSON object prefix
        self._open: int | None = None
        self._input_tokens: int | None = None
        self._output_tokens: int | None = None
        self._generated_ids = 0
        self._finish_reason: str | None = None
        self._vllm_stop_reason: Any = None
        self._stop: tuple[str, str | None] | None = None

    def start(self, input_tokens: int | None = None) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        self._input_tokens = input_tokens
        message = self._snapshot(content=[], stop=(None, None), usage=_usage(input_tokens, 0))
        return [encode_event("message_start", {"type": "message_start", "message": message})]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        if self.done:
            return []
        events: list[bytes] = []
        if not self.started:
            prompt_ids = chunk.get("prompt_token_ids")
            events += self.start(len(prompt_ids) if isinstance(prompt_ids, list) else None)
        if chunk.get("object") == "error" or chunk.get("error"):
            error = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
            return events + self.error("api_error", str(error.get("message") or "upstream error"))
        prompt_tokens, completion_tokens, _ = usage_counts(chunk.get("usage"))
        if prompt_tokens is not None:
            self._input_tokens = prompt_tokens
        if completion_tokens is not None:
            self._output_tokens = completion_tokens
        choice = first_choice(chunk)
        if choice is None:
            return events
        self._generated_ids += len(choice.get("token_ids") or ())
        delta = choice.get("delta") or {}
        reasoning = reasoning_text(delta)
        if reasoning:
            events += self._text_like("thinking", reasoning)
        if delta.get("content"):
            events += self._text_like("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._tool_delta(call)
        if choice.get("finish_reason"):
            self._finish_reason = choice["finish_reason"]
            self._vllm_stop_reason = choice.get("stop_reason")
        return events

    def finish(self) -> list[bytes]:
        if self.done:
            return []
        events = self.start() if not self.started else []
        events += self._close()
        events += self._ping()
        self.done = True
        has_tool_use = any(block["type"] == "tool_use" for block in self._blocks)
        self._stop = stop_reason_of(self._finish_reason, self._vllm_stop_reason, has_tool_use)
        delta = {"stop_reason": self._stop[0], "stop_sequence": self._stop[1]}
        usage = _usage(self._input_tokens, self._output_count())
        events.append(
            encode_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        )
        events.append(encode_event("message_stop", {"type": "message_stop"}))
        return events

    def error(self, error_type: str, message: str) -> list[bytes]:
        """An `event: error` that ends the stream (Anthropic's shape for mid-stream failures)."""
        if self.done:
            return []
        self.done = True
        payload = {"type": "error", "error": {"type": error_type, "message": message}}
        return [encode_event("error", payload)]

    @property
    def message(self) -> dict[str, Any]:
        """The message assembled so far (complete after `finish()`), as `chat_to_message` would give."""
        content = []
        for block, text in zip(self._blocks, self._texts, strict=True):
            block = dict(block)
            if block["type"] == "tool_use":
                block["input"] = parse_tool_input(text.text())
            else:
                block[block["type"]] = text.text()  # "text" or "thinking"
            content.append(block)
        stop = self._stop or (None, None)
        return self._snapshot(
            content=content, stop=stop, usage=_usage(self._input_tokens, self._output_count())
        )

    # -- internals --

    def _snapshot(
        self, *, content: list[Any], stop: tuple[str | None, str | None], usage: dict
    ) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def _output_count(self) -> int:
        # The usage chunk is authoritative; without it, count the generated token ids.
        return self._output_tokens if self._output_tokens is not None else self._generated_ids

    def _ping(self) -> list[bytes]:
        if self._pinged:
            return []
        self._pinged = True
        return [encode_event("ping", {"type": "ping"})]

    def _open_block(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        index = len(self._blocks)
        self._blocks.append(block)
        self._texts.append(TextBuffer())
        self._open = index
        start = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return [*events, encode_event("content_block_start", start), *self._ping()]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        events = self._finish_arguments(index) if self._blocks[index]["type"] == "tool_use" else []
        events.append(encode_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return encode_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def _text_like(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._blocks[self._open]["type"] != kind:
            empty = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            events += self._open_block(empty)
        index = self._open
        assert index is not None
        self._texts[index].append(text)
        delta = (
            {"type": "text_delta", "text": text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": text}
        )
        events.append(self._delta(index, delta))
        return events

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        tool_index = call.get("index", 0)
        function = call.get("function") or {}
        block_index = self._tool_blocks.get(tool_index)
        if block_index is None:
            name = function.get("name") or ""
            block = {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": self.tool_names.get(name, name),
                "input": {},
            }
            events += self._open_block(block)
            block_index = self._tool_blocks[tool_index] = len(self._blocks) - 1
        fragment = function.get("arguments") or ""
        if fragment:
            self._texts[block_index].append(fragment)
            # A fragment for a block already closed cannot be streamed any more (vLLM sends tool
            # calls one after the other, so this does not happen); it still reaches `.message`.
            if block_index == self._open:
                events += self._stream_arguments(block_index)
        return events

    def _stream_arguments(self, index: int) -> list[bytes]:
        """Send the arguments not yet sent, if the text so far is a prefix of a JSON object.

        Clients parse the concatenated `partial_json` as they go (the SDKs with a partial JSON
        parser) and fail on anything else. A model's arguments can be anything (a small model
        wrote `true`), so a fragment is only sent while the text is still a valid object prefix;
        after the first invalid one the block sends nothing more (see `_finish_arguments`).
        """
        if index in self._broken:
            return []
        buffer, sent = self._texts[index], self._sent.get(index, 0)
        if buffer.length - sent < sent // 8:
            return []  # validate in batches that grow with the text: linear cost for long arguments
        text = buffer.text()
        start = text.lstrip()
        if not start:
            return []
        if not start.startswith("{"):
            self._broken.add(index)
            return []
        try:
            valid = isinstance(from_json(text, allow_partial=True), dict)
        except ValueError:
            valid = False
        if not valid:
            self._broken.add(index)
            return []
        return self._send_arguments(index, text)

    def _finish_arguments(self, index: int) -> list[bytes]:
        """At block close: send what is left, or, when nothing was sent, `{"_raw": text}`."""
        text = self._texts[index].text()
        value = parse_tool_input(text)
        if self._sent.get(index, 0) == 0:
            return self._send_arguments(index, dumps_arguments(value)) if RAW_ARGUMENTS_KEY in value else []
        if index not in self._broken and RAW_ARGUMENTS_KEY not in value:
            return self._send_arguments(index, text)  # e.g. trailing whitespace held back
        return []

    def _send_arguments(self, index: int, text: str) -> list[bytes]:
        fragment = text[self._sent.get(index, 0) :]
        self._sent[index] = len(text)
        if not fragment:
            return []
        return [self._delta(index, {"type": "input_json_delta", "partial_json": fragment})]
