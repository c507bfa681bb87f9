"""`atdp export --format atif`: sessions as Harbor's Agent Trajectory Interchange Format (ATIF v1.4).

One trajectory per session, one per line (a single session is one line: a valid ATIF file). It is
built from the ATDP session document (`proxy.store.read.session_document`), so it holds exactly what
the store holds: redacted contents, the engine's token ids, behaviour logprobs.

The mapping (docs/export.md):
- a system prompt, when it first appears or changes, is a `system` step; a new user message a
  `user` step; a new `system`/`developer` message a `system` step;
- each recorded model call is an `agent` step: its text, reasoning and tool calls; `metrics` carries
  the prompt and completion token ids and logprobs (ATIF 1.4) and the token counts;
- a tool result is the `observation` of the agent step whose call it answers (by tool call id);
- what ATIF has no field for (versions, governance, rewards, masks, ids, errors) goes under
  `extra.atdp`, ATIF's place for extensions, on the trajectory, the agent and each step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

import orjson
from sqlalchemy.orm import Session as DbSession

from atdp_schema import models as m
from atdp_schema.models import ATDP_VERSION
from proxy.store.read import session_document
from proxy.store.tokens import TRAINABLE_SOURCES

ATIF_VERSION = "ATIF-v1.4"
_SYSTEM_ROLES = ("system", "developer")


def _text(content: Any) -> str:
    """ATIF messages are strings: text parts joined, anything else as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            else:
                parts.append(orjson.dumps(block).decode())
        return "\n".join(parts)
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    return orjson.dumps(content).decode()


def _arguments(arguments: Any) -> dict[str, Any]:
    """ATIF wants an object; clients send a JSON string (chat) or an object (messages)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    # Not an object (a redacted or malformed string): kept whole, under a key ATIF readers can show.
    return {"_raw": arguments}


def _unwrap(item: Any) -> Any:
    """A tool result's payload: a chat `tool` message's content, an Anthropic `tool_result` block's
    content, a Responses `function_call_output` item's output."""
    if isinstance(item, dict):
        for key in ("content", "output"):
            if key in item:
                return item[key]
    return item


def _iso(when: Any) -> str:
    return when.isoformat().replace("+00:00", "Z")


def _message(msg: m.Message) -> tuple[str | None, str, Any]:
    """(role, text, raw content) of an input message in any of the three APIs' shapes."""
    content = msg.content
    role = msg.role
    if isinstance(content, dict):
        role = role or content.get("role")
        if content.get("type") == "function_call_output":  # Responses API tool output
            role = "tool"
        content = content.get("content", content.get("output", content))
    return role, _text(content), msg.content


def trajectory(doc: m.Session, *, eligible_only: bool = False) -> dict[str, Any]:
    """One ATDP session document -> one ATIF trajectory (a dict valid against the ATIF schema)."""
    steps: list[dict[str, Any]] = []
    by_call: dict[str, dict[str, Any]] = {}  # tool call id -> the agent step that made it
    rewards = {f.step_id: f.reward for f in doc.feedback if f.step_id is not None and f.reward is not None}
    system_hash: str | None = None
    models: list[str] = []
    totals = {"prompt": 0, "completion": 0}

    def add(step: dict[str, Any]) -> dict[str, Any]:
        step["step_id"] = len(steps) + 1
        steps.append(step)
        return step

    for st in doc.steps:
        keep = not eligible_only or (st.governance.eligibility == m.Eligibility.eligible
                                     and st.tokens.source in TRAINABLE_SOURCES)
        if not keep:
            continue
        when = _iso(st.timings.started_at)
        obs = st.observation
        if obs.system is not None and obs.system.hash != system_hash:
            system_hash = obs.system.hash
            system = obs.system.content
            if isinstance(system, dict) and "content" in system:  # chat: the system message itself
                system = system["content"]
            add({"timestamp": when, "source": "system", "message": _text(system),
                 "extra": {"atdp": {"content_hash": obs.system.hash}}})
        answered = {r.tool_call_id for r in obs.tool_results}
        for msg in obs.messages:
            if msg.hash == system_hash:
                continue  # the system prompt, emitted above
            role, text, raw = _message(msg)
            if role == "tool" or (role == "user" and answered and _only_tool_results(raw)):
                continue  # carried by tool_results below, as the observation of the step that asked
            if role in _SYSTEM_ROLES:
                add({"timestamp": when, "source": "system", "message": text,
                     "extra": {"atdp": {"content_hash": msg.hash, "role": role}}})
            elif role == "assistant":  # history the proxy did not serve (a client's first call)
                add({"timestamp": when, "source": "agent", "message": text,
                     "extra": {"atdp": {"content_hash": msg.hash, "recorded_call": False}}})
            else:
                add({"timestamp": when, "source": "user", "message": text,
                     "extra": {"atdp": {"content_hash": msg.hash, "role": role}}})
        orphans = []
        for r in obs.tool_results:
            result = {"source_call_id": r.tool_call_id, "content": _text(_unwrap(r.content))}
            asker = by_call.get(r.tool_call_id)
            if asker is not None:
                asker.setdefault("observation", {"results": []})["results"].append(result)
                if r.is_error:
                    asker["extra"]["atdp"].setdefault("tool_errors", []).append(r.tool_call_id)
            else:  # its call is not in this export (filtered out): a system observation, unlinked
                orphans.append({"content": result["content"]})
        if orphans:
            add({"timestamp": when, "source": "system", "message": "",
                 "observation": {"results": orphans}, "extra": {"atdp": {"unlinked_tool_results": True}}})
        add(_agent_step(st, when, rewards.get(st.id), by_call, models, totals))

    agent: dict[str, Any] = {"name": doc.client or "unknown", "version": "unknown",
                             "extra": {"atdp": {"note": "the client's own version is not recorded by the proxy"}}}
    if models:
        agent["model_name"] = models[0]
    return {
        "schema_version": ATIF_VERSION,
        "session_id": doc.id,
        "agent": agent,
        "steps": steps,
        "final_metrics": {"total_prompt_tokens": totals["prompt"], "total_completion_tokens": totals["completion"],
                          "total_steps": len(steps)},
        "extra": {"atdp": {
            "atdp_version": ATDP_VERSION, "tenant": doc.tenant, "task_id": doc.task_id, "status": doc.status,
            "started_at": _iso(doc.started_at), "ended_at": _iso(doc.ended_at) if doc.ended_at else None,
            "labels": doc.labels, "reward": doc.reward, "replay_of": doc.replay_of,
            "feedback": [f.model_dump(mode="json") for f in doc.feedback],
            "eligible_only": eligible_only,
        }},
    }


def _only_tool_results(content: Any) -> bool:
    """An Anthropic user message that only carries tool results (they are in `tool_results`)."""
    if isinstance(content, dict):
        content = content.get("content")
    return isinstance(content, list) and bool(content) and all(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


def _agent_step(st: m.Step, when: str, reward: float | None, by_call: dict[str, dict[str, Any]],
                models: list[str], totals: dict[str, int]) -> dict[str, Any]:
    tok = st.tokens
    metrics: dict[str, Any] = {
        "prompt_tokens": len(tok.prompt_token_ids) or st.usage.prompt_tokens,
        "completion_tokens": len(tok.output_token_ids) or st.usage.completion_tokens,
    }
    if tok.prompt_token_ids:
        metrics["prompt_token_ids"] = tok.prompt_token_ids
    if tok.output_token_ids:
        metrics["completion_token_ids"] = tok.output_token_ids
    if tok.output_logprobs:
        metrics["logprobs"] = tok.output_logprobs
    if st.usage.cost is not None:  # the operator's unit, not necessarily USD: an extension
        metrics["extra"] = {"atdp_cost": st.usage.cost}
    totals["prompt"] += metrics["prompt_tokens"]
    totals["completion"] += metrics["completion_tokens"]
    step: dict[str, Any] = {"timestamp": when, "source": "agent", "message": st.action.text or ""}
    if st.model:
        step["model_name"] = st.model
        if st.model not in models:
            models.append(st.model)
    if st.action.reasoning:
        step["reasoning_content"] = st.action.reasoning
    if st.action.tool_calls:
        step["tool_calls"] = [{"tool_call_id": c.id, "function_name": c.name, "arguments": _arguments(c.arguments)}
                              for c in st.action.tool_calls]
    step["metrics"] = metrics
    step["extra"] = {"atdp": {
        "step_id": st.id, "seq": st.seq, "parent_step_id": st.parent_step_id, "status": st.status,
        "error": st.error.model_dump(mode="json") if st.error else None, "upstream": st.upstream,
        "model_version": st.model_version, "token_source": tok.source, "prompt_path": tok.prompt_path,
        "output_versions": [r.model_dump(mode="json") for r in tok.output_versions],
        "output_mask": tok.output_mask, "finish_reason": tok.finish_reason,
        "ttft_ms": st.timings.ttft_ms, "total_ms": st.timings.total_ms,
        "governance": st.governance.model_dump(mode="json"), "reward": reward,
        "trained_in": st.trained_in, "replay_of": st.replay_of, "params": st.observation.params,
    }}
    for c in st.action.tool_calls:
        by_call[c.id] = step
    return step


def write_atif(s: DbSession, sessions: Iterator[Any], out: IO[bytes], *, reward_combine_for: Any,
               eligible_only: bool) -> tuple[int, int]:
    """Each session as one line of ATIF JSON; (sessions, agent steps) written."""
    n_sessions = n_steps = 0
    for session in sessions:
        doc = session_document(s, session, reward_combine=reward_combine_for(session.tenant_id))
        traj = trajectory(doc, eligible_only=eligible_only)
        out.write(orjson.dumps(traj) + b"\n")
        n_sessions += 1
        n_steps += sum(1 for x in traj["steps"] if "metrics" in x)
        s.expunge_all()  # drop this session's rows: memory stays bounded
    return n_sessions, n_steps
