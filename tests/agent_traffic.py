"""Multi-turn tool-calling conversations shaped like three real agents, through the official SDKs.

- Hermes Agent: `/v1/chat/completions`, a `terminal` tool, no session id (linked by continuation).
- Claude Code: `/v1/messages`, `system` as blocks, a `Bash` tool, `X-Claude-Code-Session-Id`.
- Codex CLI: `/v1/responses`, `developer` messages, an `exec_command` tool, input echoed whole.

Each turn but the last forces a tool call (`tool_choice`), the client echoes the answer back as its
SDK returned it and adds a tool result, as the agents do. Shared by tests/integration/test_tito_vllm.py
and bench/prefix_exact.py (which also measures the share of continuations that are prefix-exact).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import anthropic
import openai

TERMINAL = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
BASH = {"type": "object", "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"]}  # fmt: skip
EXEC = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
TOOL_TOKENS = 96  # a forced call's arguments fit; the tiny model's JSON strings can run long
LAST_TOKENS = 12


@dataclass
class Conversation:
    door: str
    stream: bool
    session_hint: str | None  # the session id the client named, if any


def _chat_stream_message(stream: Any) -> dict[str, Any]:
    """The assistant message an OpenAI SDK user assembles from a streamed chat completion."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            if d.content:
                content.append(d.content)
            for tc in d.tool_calls or ():
                cur = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                cur["id"] = cur["id"] or tc.id or ""
                if tc.function is not None:
                    cur["function"]["name"] += tc.function.name or ""
                    cur["function"]["arguments"] += tc.function.arguments or ""
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def hermes(base_v1: str, model: str, *, turns: int = 3, stream: bool = False) -> Conversation:
    client = openai.OpenAI(api_key="k", base_url=base_v1, default_headers={"user-agent": "HermesAgent/0.19"})
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are Hermes, an agent with a terminal."},
        {"role": "user", "content": "How many Python files are in this repository?"},
    ]
    tools = [{"type": "function", "function": {"name": "terminal", "description": "Run a shell command",
                                                  "parameters": TERMINAL}}]  # fmt: skip
    for turn in range(turns):
        last = turn == turns - 1
        kw: dict[str, Any] = {"model": model, "messages": messages, "tools": tools, "temperature": 0}
        if last:
            kw.update(tool_choice="none", max_tokens=LAST_TOKENS)
        else:
            kw.update(tool_choice={"type": "function", "function": {"name": "terminal"}}, max_tokens=TOOL_TOKENS)
        if stream:
            msg = _chat_stream_message(client.chat.completions.create(stream=True, **kw))
        else:
            msg = client.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
            msg = {k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")}
        if last:
            break
        messages.append(msg)
        for tc in msg.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"{12 + turn}\n"})
        messages.append({"role": "user", "content": "Now count the test files."})
    return Conversation("chat", stream, None)


def claude_code(base_url: str, model: str, *, turns: int = 3, stream: bool = False) -> Conversation:
    session = str(uuid.uuid4())
    client = anthropic.Anthropic(api_key="k", base_url=base_url,
                                 default_headers={"x-claude-code-session-id": session, "user-agent": "claude-cli/2.1"})
    system = [{"type": "text", "text": "You are Claude Code."},
              {"type": "text", "text": "Use Bash to inspect the repository.", "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": "Bash", "description": "Run a command", "input_schema": BASH}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Which tests fail?"}]}]
    for turn in range(turns):
        last = turn == turns - 1
        # (this SDK takes no `temperature` argument; Claude Code sends one, as a body field)
        kw: dict[str, Any] = {"model": model, "system": system, "messages": messages, "tools": tools,
                              "extra_body": {"temperature": 0}}
        if last:
            kw.update(tool_choice={"type": "none"}, max_tokens=LAST_TOKENS)
        else:
            kw.update(tool_choice={"type": "tool", "name": "Bash"}, max_tokens=TOOL_TOKENS)
        if stream:
            with client.messages.stream(**kw) as s:
                answer = s.get_final_message()
        else:
            answer = client.messages.create(**kw)
        if last:
            break
        blocks = [b.model_dump(exclude_none=True) for b in answer.content]
        messages.append({"role": "assistant", "content": blocks})
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": f"FAILED test_{turn}.py"}
                   for b in blocks if b["type"] == "tool_use"]
        messages.append({"role": "user", "content": [*results, {"type": "text", "text": "And the next one?"}]})
    return Conversation("messages", stream, session)


def codex(base_v1: str, model: str, *, turns: int = 3, stream: bool = False) -> Conversation:
    client = openai.OpenAI(api_key="k", base_url=base_v1, default_headers={"user-agent": "codex_exec/0.171"})
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the source files."}]},
    ]
    tools = [{"type": "function", "name": "exec_command", "description": "Run a command", "parameters": EXEC,
              "strict": False}]
    for turn in range(turns):
        last = turn == turns - 1
        kw: dict[str, Any] = {"model": model, "input": items, "tools": tools, "store": False, "temperature": 0}
        if last:
            kw.update(tool_choice="none", max_output_tokens=LAST_TOKENS)
        else:
            kw.update(tool_choice={"type": "function", "name": "exec_command"}, max_output_tokens=TOOL_TOKENS)
        if stream:  # (the SDK's stream helper wants `response.completed`; a cut answer ends `incomplete`)
            ends = ("response.completed", "response.incomplete")
            answer = next(e.response for e in client.responses.create(stream=True, **kw) if e.type in ends)
        else:
            answer = client.responses.create(**kw)
        if last:
            break
        outputs = [o.model_dump(exclude_none=True) for o in answer.output]
        items += outputs
        items += [{"type": "function_call_output", "call_id": o["call_id"], "output": f"src/{turn}.py"}
                  for o in outputs if o["type"] == "function_call"]
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More?"}]})
    return Conversation("responses", stream, None)


def prefix_exact(steps: list[Any]) -> tuple[int, int]:
    """(continuations whose prompt ids begin with the parent's prompt+output ids, continuations):
    `steps` are ATDP `Step` documents (their `tokens.prompt_token_ids` are whole prompts)."""
    by_id = {s.id: s for s in steps}
    exact = total = 0
    for s in steps:
        parent = by_id.get(s.parent_step_id) if s.parent_step_id else None
        if parent is None:
            continue
        total += 1
        before = parent.tokens.prompt_token_ids + parent.tokens.output_token_ids
        exact += s.tokens.prompt_token_ids[: len(before)] == before
    return exact, total
