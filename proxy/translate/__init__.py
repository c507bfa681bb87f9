"""Translation between the client-facing APIs and vLLM's chat completions.

atdp sends every model call to vLLM's `/v1/chat/completions`, the only route that returns token
ids; `/v1/messages` (Anthropic) and `/v1/responses` (OpenAI Responses) are translated to it and the
answers translated back. The modules here are pure: JSON-shaped data in, JSON-shaped data (or SSE
bytes) out, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatRequest", "TranslationError"]


class TranslationError(Exception):
    """A client request that cannot be translated; the route renders it in the API's error format."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def __repr__(self) -> str:
        return f"TranslationError(status={self.status!r}, message={self.message!r})"


@dataclass
class ChatRequest:
    """A translated request: the chat completions body plus what is needed to translate back.

    `tool_names` maps the upstream (chat) function name to the client's name: a plain string for
    Anthropic (identity), a `(namespace, name)` pair for Responses (namespace None for a top-level
    function tool).
    """

    body: dict[str, Any]
    tool_names: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
