"""Rebuilding a recorded step's input and the chat-completions body that replays it.

Shared by `atdp replay` (proxy.tools.replay) and the replay gate (proxy.rollout.gates): each step's
full input is rebuilt from the store as recorded (redacted): its ancestors' new messages plus their
outputs, up to its `history_len`, then its own new messages. Anthropic Messages and Responses steps
are translated to chat completions (the only vLLM route that returns token ids).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.store import tables as t

_ASSISTANT_KEYS = ("role", "content", "tool_calls", "name")


# --- rebuilding inputs -----------------------------------------------------------------------------


def output_units(api: str, output: Any) -> list[Any]:
    """What a client echoes back next turn for a step's output, in the step's API shape."""
    if output is None:
        return []
    if api == "responses":
        if isinstance(output, dict) and isinstance(output.get("output"), list):
            return list(output["output"])  # a whole response object
        return list(output) if isinstance(output, list) else [output]
    if api == "messages" and isinstance(output, dict) and output.get("type") == "message":
        return [{"role": "assistant", "content": output.get("content")}]
    if api == "chat.completions" and isinstance(output, dict):
        return [{k: v for k, v in output.items() if k in _ASSISTANT_KEYS and (v is not None or k == "content")}]
    return [output]


def rebuild_inputs(steps: dict[str, t.Step], contents: dict[str, Any],
                   fetch: Callable[[str, str], t.Step | None] | None = None) -> dict[str, list[Any]]:
    """Each step's full input messages: (parent's input + parent's output)[:history_len] + own new ones.
    `fetch(parent_id, child's session_id)` reads a parent not in `steps` (`tables.get_step`)."""
    memo: dict[str, list[Any]] = {}

    def body(h: str) -> Any:
        if h not in contents:
            raise LookupError(f"content {h[:12]}... is missing (forgotten or expired): the input cannot be rebuilt")
        return contents[h]

    def full(st: t.Step) -> list[Any]:
        if st.id in memo:
            return memo[st.id]
        own = [body(h) for h in st.message_hashes]
        if st.history_len == 0:
            memo[st.id] = own
            return own
        parent = ((steps.get(st.parent_step_id) or (fetch(st.parent_step_id, st.session_id) if fetch else None))
                  if st.parent_step_id else None)
        if parent is None:
            raise LookupError(f"step {st.id}: continues {st.history_len} earlier messages but its parent is missing")
        output = body(parent.output_hash).get("output") if parent.output_hash else None
        prior = full(parent) + output_units(parent.api, output)
        if len(prior) < st.history_len:
            raise LookupError(f"step {st.id}: history of {st.history_len} messages, only {len(prior)} recorded")
        memo[st.id] = prior[: st.history_len] + own
        return memo[st.id]

    return {sid: full(st) for sid, st in steps.items()}


def chat_request(st: t.Step, messages: list[Any], system: Any, tools: Any, model: str) -> dict[str, Any]:
    """The chat-completions body that replays one step (translated from its API when needed)."""
    params = {k: v for k, v in (st.params or {}).items() if k not in ("n", "stream", "stream_options")}
    if st.api == "chat.completions":
        body: dict[str, Any] = {**params, "model": model, "messages": [_clean_chat(m) for m in messages]}
        if tools:
            body["tools"] = tools
    elif st.api == "messages":
        from proxy.translate.anthropic import messages_to_chat

        native: dict[str, Any] = {**params, "model": model, "messages": messages}
        native.setdefault("max_tokens", 1024)
        if system is not None:
            native["system"] = system
        if tools:
            native["tools"] = tools
        body = messages_to_chat(native).body
    elif st.api == "responses":
        from proxy.translate.responses import responses_to_chat

        native = {**params, "model": model, "input": messages}
        if "max_tokens" in native:
            native["max_output_tokens"] = native.pop("max_tokens")
        if isinstance(system, str):
            native["instructions"] = system
        if tools:
            native["tools"] = tools
        body = responses_to_chat(native).body
    else:
        raise ValueError(f"step {st.id}: cannot replay api {st.api!r}")
    body.pop("stream", None)
    body.pop("stream_options", None)
    body["return_token_ids"] = True
    body["logprobs"] = True
    return body


def _clean_chat(m: Any) -> Any:
    if isinstance(m, dict) and m.get("role") == "assistant":
        return {k: v for k, v in m.items() if v is not None or k == "content"}
    return m
