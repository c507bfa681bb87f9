"""`atdp export --for sft`: supervised / distillation samples, chat-format JSONL for TRL's SFTTrainer.

One line per assistant turn (per step): `{"messages": [...], "tools": [...]}`, the conversation as
the model saw it with that step's answer as the last message, in the conversational
language-modeling format TRL documents (tool calls as `{"type": "function", "function": {"name",
"arguments": {...}}}`, tool results as `role: tool` with the tool's `name`, tools as JSON schemas).
Per turn rather than per session: a session's later turns carry its earlier answers as history, and
an earlier answer that was not eligible (PII, no consent) must not be trained on as a target.

Which steps: status `ok`, eligibility `eligible` (consent, redaction policy), with any token source,
so provider steps (token source `none`, never leased for PPO) are in. The text is the stored, redacted
text: inputs are rebuilt from the store (`record.replay_inputs`) and Anthropic Messages and Responses
steps are translated to chat messages by the doors' own translators.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session

from atdp_schema.models import Eligibility, StepStatus, TokenSource
from proxy.record.replay_inputs import chat_request, output_units, rebuild_inputs
from proxy.store import tables as t
from proxy.store.read import load_contents
from proxy.translate import TranslationError

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass
class SftStats:
    sessions: int = 0
    steps: int = 0  # lines written
    skipped: int = 0  # eligible steps that could not be rebuilt (forgotten content, invalid arguments)


def _text(content: Any) -> str:
    """A chat message's content as one string (text parts joined; TRL's templates expect a string)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") in ("text", None))
    return orjson.dumps(content).decode()


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        args = orjson.loads(args) if args.strip() else {}  # invalid JSON raises: the step is skipped
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return {"type": "function", "function": {"name": fn.get("name") or "", "arguments": args}}


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-completions messages -> TRL's conversational shape (only the keys chat templates read)."""
    names: dict[str, str] = {}  # tool_call_id -> function name, for the tool messages' `name`
    out = []
    for m in messages:
        role = _ROLES.get(m.get("role", ""))
        if role is None:
            raise ValueError(f"unexpected role {m.get('role')!r}")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(tc) for tc in m["tool_calls"]]
            for tc in m["tool_calls"]:
                names[tc.get("id") or ""] = (tc.get("function") or {}).get("name") or ""
        if role == "tool":
            msg["name"] = names.get(m.get("tool_call_id") or "", "")
        out.append(msg)
    return out


def step_sample(st: t.Step, inputs: list[Any], contents: dict[str, Any]) -> dict[str, Any]:
    """The SFT line of one step: its input, translated to chat, then its answer last."""
    system = contents.get(st.system_hash) if st.system_hash else None
    tools = contents.get(st.tools_hash) if st.tools_hash else None
    output = (contents.get(st.output_hash) or {}).get("output") if st.output_hash else None
    units = output_units(st.api, output)
    if not units:
        raise ValueError("the step has no stored answer")
    model = st.model or "model"
    before = chat_request(st, inputs, system, tools, model)["messages"]
    body = chat_request(st, list(inputs) + units, system, tools, model)
    messages = body["messages"]
    answer = messages[len(before):]
    # The answer translated alone must extend the input's translation, and be the assistant's.
    if messages[: len(before)] != before or not answer or any(m.get("role") != "assistant" for m in answer):
        raise ValueError("the answer does not translate to a trailing assistant turn")
    line: dict[str, Any] = {"messages": chat_messages(messages)}
    fns = [tool for tool in body.get("tools") or () if isinstance(tool, dict) and tool.get("type") == "function"]
    if fns:
        line["tools"] = fns
    return line


def session_sft(s: Session, session: t.Session, stats: SftStats, *, provider_only: bool = False
                ) -> Iterator[dict[str, Any]]:
    steps = list(s.scalars(select(t.Step).where(t.Step.session_id == session.id).order_by(t.Step.seq)))
    chosen = [st for st in steps if st.eligibility == Eligibility.eligible and st.status == StepStatus.ok
              and (not provider_only or st.token_source == TokenSource.none)]
    if not chosen:
        return
    hashes: set[str] = set()
    for st in steps:
        hashes.update(st.message_hashes)
        hashes.update(h for h in (st.system_hash, st.tools_hash, st.output_hash) if h)
    contents = load_contents(s, session.tenant_id, hashes)
    by_id = {st.id: st for st in steps}

    def fetch(step_id: str, session_id: str) -> t.Step | None:  # a parent not chosen, or in another session
        if step_id in by_id:
            return by_id[step_id]
        parent = t.get_step(s, step_id, session_id)
        if parent is not None:
            more = {h for h in [*parent.message_hashes, parent.output_hash] if h and h not in contents}
            contents.update(load_contents(s, session.tenant_id, more))
        return parent

    for st in chosen:
        try:
            inputs = rebuild_inputs({st.id: st}, contents, fetch=fetch)[st.id]
            line = step_sample(st, inputs, contents)
        except (LookupError, ValueError, TranslationError, orjson.JSONDecodeError):
            stats.skipped += 1
            continue
        stats.steps += 1
        yield line


def write_sft(s: Session, sessions: Iterator[t.Session], out: IO[bytes], *, provider_only: bool = False) -> SftStats:
    stats = SftStats()
    for session in sessions:
        stats.sessions += 1
        for line in session_sft(s, session, stats, provider_only=provider_only):
            out.write(orjson.dumps(line) + b"\n")
        s.expunge_all()  # memory stays bounded by one session
    return stats
