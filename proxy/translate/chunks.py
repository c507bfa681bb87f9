"""One reader for vLLM's chat completion output: what a chunk (or a whole completion) carries.

The capture (`proxy.record.capture`) and both translated streams (`anthropic_stream`,
`responses_stream`) read chunks through `read_chunk`, so what counts as text, reasoning, a tool-call
fragment, token ids, usage or a mid-stream error is decided in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from proxy.translate._chat import first_choice, reasoning_text


class Chunk(NamedTuple):
    """What one chunk carries (choice 0). Built once per chunk on the streaming hot path: a tuple, and
    the chunk's own lists are referenced, not copied (callers only read them)."""

    id: str | None
    model: str | None
    error: str | None  # vLLM's mid-stream failure (an error chunk); nothing else is read then
    prompt_token_ids: list[int] | None
    usage: dict[str, Any] | None
    has_choice: bool  # choice 0 is present (the usage-only last chunk has none)
    token_ids: Sequence[int]
    logprobs: Sequence[dict[str, Any]]  # {"token", "logprob", ...} per token
    content: str | None
    reasoning: str | None
    tool_calls: Sequence[dict[str, Any]]  # fragments: index, id, function
    finish_reason: str | None
    stop_reason: Any
    # The engine's `WeightVersionSpan`s ({version, start, end} over output tokens), on the last chunk
    # of a token-in-token-out answer (proxy.tito); () from the chat route, which reports none.
    weight_versions: Sequence[dict[str, Any]] = ()


def error_message(chunk: dict[str, Any]) -> str | None:
    """The message of an error chunk (`{"error": {...}}` or `{"object": "error", ...}`), else None."""
    if not (chunk.get("object") == "error" or chunk.get("error")):
        return None
    error = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
    return str(error.get("message") or "upstream error")


def read_chunk(chunk: dict[str, Any]) -> Chunk:
    """One streamed `chat.completion.chunk` (choice 0 only: atdp records n=1)."""
    get = chunk.get
    if get("error") or get("object") == "error":  # (`error_message`'s test, inline: once per token)
        return Chunk(get("id"), get("model"), error_message(chunk), None, None, False, (), (), None, None, (), None,
                     None)
    ids = get("prompt_token_ids")
    return _with_choice(chunk, ids if isinstance(ids, list) else None, get("usage") or None, "delta")


def read_completion(completion: dict[str, Any]) -> Chunk:
    """A non-streamed `chat.completion`, read as one chunk carrying the whole answer."""
    ids = completion.get("prompt_token_ids")  # the parsed list itself: an agent's prompt is tens of thousands of ids
    return _with_choice(completion, ids if isinstance(ids, list) else [], completion.get("usage"), "message")


def _with_choice(chunk: dict[str, Any], prompt_ids: list[int] | None, usage: dict[str, Any] | None,
                 key: str) -> Chunk:
    choices = chunk.get("choices")
    # One choice 0 (every chunk atdp asks for, n=1): taken without first_choice's search.
    one = type(choices) is list and len(choices) == 1 and type(choices[0]) is dict and choices[0].get("index", 0) == 0
    choice = choices[0] if one else first_choice(chunk)
    if choice is None:
        return Chunk(chunk.get("id"), chunk.get("model"), None, prompt_ids, usage, False, (), (), None, None, (),
                     None, None)
    delta = choice.get(key) or {}
    calls = delta.get("tool_calls") or ()
    if key == "message":  # a whole message's calls carry no index: their position is it
        calls = [{**tc, "index": i} for i, tc in enumerate(calls)]
    lp = choice.get("logprobs")
    return Chunk(
        chunk.get("id"), chunk.get("model"), None, prompt_ids, usage, True, choice.get("token_ids") or (),
        (lp.get("content") or ()) if isinstance(lp, dict) else (), delta.get("content") or None,
        reasoning_text(delta), calls, choice.get("finish_reason") or None, choice.get("stop_reason"),
        choice.get("weight_versions") or (),
    )
