"""Small helpers on the chat completions side, shared by both translators."""

from __future__ import annotations

import json
from typing import Any


def dumps_arguments(value: Any) -> str:
    """Tool arguments as the JSON string chat completions carries.

    `ensure_ascii=False` and the default `", "`/`": "` separators: the shape models usually write,
    so a round-tripped call renders close to what the model produced.
    """
    return json.dumps(value, ensure_ascii=False)


def first_choice(chat: dict[str, Any]) -> dict[str, Any] | None:
    """Choice 0 of a response or chunk (n > 1 is not offered on the translated routes)."""
    for choice in chat.get("choices") or ():
        if choice.get("index", 0) == 0:
            return choice
    return None


def reasoning_text(message_or_delta: dict[str, Any]) -> str | None:
    """The reasoning text vLLM's reasoning parsers put beside `content` (name changed across versions)."""
    value = message_or_delta.get("reasoning")
    if value is None:
        value = message_or_delta.get("reasoning_content")
    return value or None


def usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int]:
    """(prompt tokens, completion tokens, cached prompt tokens) from a chat `usage` object."""
    if not usage:
        return None, None, 0
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens") or 0


def text_of(value: Any) -> str:
    """Text of a string or of a list of text parts, joined with newlines (as vLLM joins text parts)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(part.get("text", "") for part in value if isinstance(part, dict) and "text" in part)
    return json.dumps(value, ensure_ascii=False)  # a structured tool output: the model reads it as JSON


class TextBuffer:
    """Text that grows by small fragments: appends are O(1), the join happens when text is read
    (repeated `str +=` on a dict value copies the whole text every time: quadratic in length)."""

    __slots__ = ("_parts", "length")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.length = 0

    def append(self, fragment: str) -> None:
        self._parts.append(fragment)
        self.length += len(fragment)

    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""
