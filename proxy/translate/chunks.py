"""One reader for vLLM's chat completion output: what a chunk (or a whole completion) carries.

The capture (`proxy.record.capture`) and both translated streams (`anthropic_stream`,
`responses_stream`) read chunks through `read_chunk`, so what counts as text, reasoning, a tool-call
fragment, token ids, usage or a mid-stream error is decided in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.translate._chat import first_choice, reasoning_text


@dataclass(slots=True)
class Chunk:
    id: str | None = None
    model: str | None = None
    error: str | None = None  # vLLM's mid-stream failure (an error chunk); nothing else is read then
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    has_choice: bool = False  # choice 0 is present (the usage-only last chunk has none)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # {"token", "logprob", ...} per token
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # fragments: index, id, function
    finish_reason: str | None = None
    stop_reason: Any = None


def error_message(chunk: dict[str, Any]) -> str | None:
    """The message of an error chunk (`{"error": {...}}` or `{"object": "error", ...}`), else None."""
    if not (chunk.get("object") == "error" or chunk.get("error")):
        return None
    error = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
    return str(error.get("message") or "upstream error")


def read_chunk(chunk: dict[str, Any]) -> Chunk:
    """One streamed `chat.completion.chunk` (choice 0 only: atdp records n=1)."""
    out = Chunk(id=chunk.get("id"), model=chunk.get("model"), error=error_message(chunk))
    if out.error is not None:
        return out
    ids = chunk.get("prompt_token_ids")
    out.prompt_token_ids = list(ids) if isinstance(ids, list) else None
    out.usage = chunk.get("usage") or None
    choice = first_choice(chunk)
    if choice is not None:
        _read_choice(out, choice, choice.get("delta") or {})
    return out


def read_completion(completion: dict[str, Any]) -> Chunk:
    """A non-streamed `chat.completion`, read as one chunk carrying the whole answer."""
    out = Chunk(id=completion.get("id"), model=completion.get("model"), error=None,
                prompt_token_ids=list(completion.get("prompt_token_ids") or []), usage=completion.get("usage"))
    choice = first_choice(completion)
    if choice is not None:
        msg = choice.get("message") or {}
        delta = {**msg, "tool_calls": [{**tc, "index": i} for i, tc in enumerate(msg.get("tool_calls") or [])]}
        _read_choice(out, choice, delta)
    return out


def _read_choice(out: Chunk, choice: dict[str, Any], delta: dict[str, Any]) -> None:
    out.has_choice = True
    out.token_ids = list(choice.get("token_ids") or ())
    lp = choice.get("logprobs")
    out.logprobs = list(lp.get("content") or ()) if isinstance(lp, dict) else []
    out.content = delta.get("content") or None
    out.reasoning = reasoning_text(delta)
    out.tool_calls = list(delta.get("tool_calls") or ())
    out.finish_reason = choice.get("finish_reason") or None
    out.stop_reason = choice.get("stop_reason")
