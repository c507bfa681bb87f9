"""Agent-sized captured steps, built the way the proxy captures a tool-using agent (no HTTP).

One session: a system prompt and tool schemas (sent every call, stored once), then per turn the
agent echoes the model's last tool call and sends its result (code, shell output, JSON, prose from
bench/redaction_throughput.py's generators); the model answers with a new tool call. Token ids
grow like a real conversation: each prompt is the parent's prompt + output + the new messages' ids,
so the writer's prefix storage sees what it sees in production.

Shared by bench/write_path.py and bench/storage.py; only APIs that exist on main too (CapturedStep,
SessionRef, ToolResultIn, new_id), so a baseline checkout can run the same builder.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import orjson
from redaction_throughput import code, json_blob, prose, shell

from proxy.record.capture import CapturedStep, SessionRef, ToolResultIn
from proxy.store.ids import new_id

VOCAB = 49_152  # SmolLM2's vocabulary size
TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')}: {desc}",
        "parameters": {"type": "object", "properties": {p: {"type": "string", "description": f"the {p}"} for p in params},
                       "required": list(params[:1])}}}
    for name, desc, params in [
        ("read_file", "read a file of the workspace, whole or a line range", ("path", "start", "end")),
        ("write_file", "replace a file's content", ("path", "content")),
        ("run_shell", "run a shell command in the workspace and return its output", ("command", "timeout")),
        ("search", "search the workspace for a regular expression", ("pattern", "glob")),
        ("run_tests", "run the test suite, or the tests matching a pattern", ("pattern",)),
    ]
]
SYSTEM = ("You are a coding agent working in a git repository. Read before you write; run the tests after "
          "every change; keep changes small and explain each one in one sentence. ") * 6


def _ids(rng: random.Random, text_chars: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(max(1, text_chars // 4))]


def _result(rng: random.Random, turn: int) -> str:
    kind = turn % 4
    n = rng.randint(600, 1600)
    return (code, shell, json_blob, prose)[kind](rng, n)


def session_steps(rng: random.Random, *, tenant: str, turns: int, start: datetime | None = None) -> list[CapturedStep]:
    """`turns` model calls of one agent session, parent-linked, in order."""
    ext = f"bench-{rng.getrandbits(64):016x}"
    when = start or datetime.now(UTC)
    system_msg = {"role": "system", "content": SYSTEM}
    task = {"role": "user", "content": "Fix the failing test in tests/test_parser.py. " + prose(rng, 300)}
    prompt_ids = _ids(rng, len(SYSTEM) + len(orjson.dumps(TOOLS)) + len(task["content"]))
    new_messages: list[dict] = [system_msg, task]
    results: list[ToolResultIn] = []
    parent: str | None = None
    history = 0
    out: list[CapturedStep] = []
    for turn in range(turns):
        step_id = new_id()
        tool = TOOLS[rng.randrange(len(TOOLS))]["function"]["name"]
        args = orjson.dumps({"path": f"src/mod_{rng.randrange(40)}.py", "start": str(rng.randrange(200))}).decode()
        call_id = f"call_{rng.getrandbits(48):012x}"
        thought = prose(rng, rng.randint(60, 240))
        output_ids = _ids(rng, len(thought) + len(args) + 40)
        native = {"role": "assistant", "content": thought,
                  "tool_calls": [{"id": call_id, "type": "function", "function": {"name": tool, "arguments": args}}]}
        out.append(CapturedStep(
            step_id=step_id, session=SessionRef(tenant=tenant, external_id=ext, source="header", client="bench"),
            api="chat.completions", started_at=when + timedelta(seconds=3 * turn), parent_step_id=parent,
            history_len=history, system=SYSTEM, tools=TOOLS, new_messages=new_messages, tool_results=results,
            params={"temperature": 0.7, "max_tokens": 1024}, action={
                "text": thought, "reasoning": None, "tool_calls": [{"id": call_id, "name": tool, "arguments": args}],
                "output": native},
            prompt_token_ids=prompt_ids, output_token_ids=output_ids,
            output_logprobs=[-rng.random() * 2 for _ in output_ids],
            finish_reason="tool_calls", status="ok", error=None, upstream="http://vllm:8000", model="agent",
            model_version="v1", ttft_ms=40.0, total_ms=900.0, prompt_tokens=len(prompt_ids),
            completion_tokens=len(output_ids), transcript_hash=f"{rng.getrandbits(256):064x}",
        ))
        result = _result(rng, turn)
        tool_msg = {"role": "tool", "tool_call_id": call_id, "content": result}
        history += len(new_messages)
        new_messages = [native, tool_msg]
        results = [ToolResultIn(call_id=call_id, content=result)]
        prompt_ids = prompt_ids + output_ids + _ids(rng, len(result) + 20)
        parent = step_id
    return out


def unique_text_bytes(steps: list[CapturedStep]) -> int:
    """Bytes of the conversation itself, each piece once (canonical JSON): its messages (system prompt,
    task, every assistant turn as the agent echoes it, every tool result), the tool schemas, and the
    last answer (the only one never echoed back)."""
    seen: dict[bytes, int] = {}
    values = [m for st in steps for m in st.new_messages]
    if steps:
        values += [steps[0].tools, steps[-1].action["output"]]
    for value in values:
        blob = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        seen[blob] = len(blob)
    return sum(seen.values())


def interleaved(rng: random.Random, *, tenant: str, sessions: int, turns: int) -> list[CapturedStep]:
    """Many sessions' steps in arrival order: turn by turn, as concurrent agents send them."""
    per = [session_steps(rng, tenant=tenant, turns=turns) for _ in range(sessions)]
    return [s[i] for i in range(turns) for s in per]
