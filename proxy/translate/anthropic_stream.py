"""Chat completions -> Anthropic Messages: one `message` object (`chat_to_message`) or the event
stream (`MessagesStream`). The request side is `proxy.translate.anthropic`.

Content becomes a `text` block, `tool_calls` become `tool_use` blocks (and reasoning, when vLLM runs a
reasoning parser, a `thinking` block with an empty signature). Arguments that are not a JSON object
are kept as `{"_raw": "<text>"}` so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json

from proxy.translate._chat import TextBuffer, dumps_arguments, first_choice, reasoning_text, usage_counts
from proxy.translate.anthropic import RAW_ARGUMENTS_KEY, STOP_REASONS
from proxy.translate.chunks import Chunk, read_chunk
from proxy.translate.sse import encode_event


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
        return self.feed_part(read_chunk(chunk))

    def feed_part(self, part: Chunk) -> list[bytes]:
        """The events for one chunk, as `read_chunk` read it (the capture reads the same)."""
        if self.done:
            return []
        events: list[bytes] = []
        if not self.started:
            events += self.start(len(part.prompt_token_ids) if part.prompt_token_ids is not None else None)
        if part.error is not None:
            return events + self.error("api_error", part.error)
        prompt_tokens, completion_tokens, _ = usage_counts(part.usage)
        if prompt_tokens is not None:
            self._input_tokens = prompt_tokens
        if completion_tokens is not None:
            self._output_tokens = completion_tokens
        if not part.has_choice:
            return events
        self._generated_ids += len(part.token_ids)
        if part.reasoning:
            events += self._text_like("thinking", part.reasoning)
        if part.content:
            events += self._text_like("text", part.content)
        for call in part.tool_calls:
            events += self._tool_delta(call)
        if part.finish_reason:
            self._finish_reason = part.finish_reason
            self._vllm_stop_reason = part.stop_reason
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
