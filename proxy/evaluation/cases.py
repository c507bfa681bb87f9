"""The replay gate's evaluation set: operator suites (JSONL files) and held-out recorded sessions.

Suite files (`ATDP_EVAL_SUITES`, every `*.jsonl` in the folder), one JSON object a line:
- a **case**: `{"messages": [...chat messages...], "evaluator": NAME, "expected": ..., "tenant"?: str,
  "id"?: str, "tools"?: [...], "max_tokens"?: int}`; `tenant` defaults to the file's stem.
- a **task rule**: `{"task": TASK, "evaluator": NAME, "expected": ...}` (no messages): how to score
  held-out recorded sessions of that task (tenant and task as recorded, `X-ATDP-Task-Id`).

Held-out sessions (proxy.store.holdout: the tenant's `eval_holdout` share, never trained on) that
have a reward and a task rule become cases: each eligible step's recorded input, rebuilt as the
replay command does, scored by the rule. Held-out steps whose task has no rule are counted, not scored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from atdp_schema.models import Eligibility
from proxy.record.replay_inputs import chat_request, rebuild_inputs
from proxy.store import tables as t
from proxy.store.holdout import held_out_sql
from proxy.store.read import load_contents

JSON = None | bool | int | float | str | list["JSON"] | dict[str, "JSON"]


@dataclass(frozen=True)
class EvalCase:
    id: str
    tenant: str
    source: str  # "suite:<file>" or "held-out:<task>"
    request: dict  # a chat-completions body without "model" (messages, tools, max_tokens)
    evaluator: str
    expected: JSON = None

    def public(self) -> dict:
        """What a command evaluator is given."""
        return {"id": self.id, "tenant": self.tenant, "source": self.source, "messages": self.request.get("messages"),
                "tools": self.request.get("tools"), "expected": self.expected}


@dataclass(frozen=True)
class Answer:
    text: str
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments" (a JSON string)}
    finish_reason: str | None = None  # the engine's ("stop", "length": cut at max_tokens, ...), when known


@dataclass(frozen=True)
class TaskRule:
    evaluator: str
    expected: JSON = None


@dataclass
class EvalSet:
    cases: list[EvalCase] = field(default_factory=list)
    rules: dict[str, TaskRule] = field(default_factory=dict)  # task id -> rule
    unscored_held_out: int = 0  # held-out steps of tasks without a rule
    held_out_sessions: int = 0


class SuiteError(ValueError):
    """A suite line that is not a case or a task rule."""


def load_suites(folder: Path | None, *, max_tokens: int) -> EvalSet:
    out = EvalSet()
    if folder is None or not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path.name}:{n}"
            try:
                item = json.loads(line)
            except ValueError as e:
                raise SuiteError(f"{where}: not JSON ({e})") from None
            if not isinstance(item, dict) or not isinstance(item.get("evaluator"), str):
                raise SuiteError(f"{where}: a case or task rule needs an 'evaluator' name")
            if "messages" not in item:
                if not isinstance(item.get("task"), str):
                    raise SuiteError(f"{where}: neither a case ('messages') nor a task rule ('task')")
                out.rules[item["task"]] = TaskRule(item["evaluator"], item.get("expected"))
                continue
            messages = item["messages"]
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise SuiteError(f"{where}: 'messages' must be a non-empty list of chat messages")
            request: dict = {"messages": messages, "max_tokens": int(item.get("max_tokens") or max_tokens)}
            if item.get("tools"):
                request["tools"] = item["tools"]
            out.cases.append(EvalCase(id=str(item.get("id") or where), tenant=str(item.get("tenant") or path.stem),
                                      source=f"suite:{path.name}", request=request, evaluator=item["evaluator"],
                                      expected=item.get("expected")))
    return out


def add_held_out(s: Session, evalset: EvalSet, holdout: tuple[dict[str, float], float], *, max_cases: int,
                 max_tokens: int) -> None:
    """Add the held-out rewarded sessions' steps (newest sessions first) as cases, up to max_cases."""
    rewarded = exists().where(t.Feedback.session_id == t.Session.id, t.Feedback.reward.is_not(None))
    sessions = list(s.scalars(
        select(t.Session).where(held_out_sql(*holdout), rewarded, t.Session.replay_of.is_(None),
                                 t.Session.status != "deleted")
        .order_by(t.Session.started_at.desc()).limit(max_cases)
    ))
    evalset.held_out_sessions = len(sessions)
    for se in sessions:
        if len(evalset.cases) >= max_cases:
            return
        # Only what the trainer would otherwise have seen: eligible steps (consent, governance) that succeeded.
        steps = list(s.scalars(select(t.Step).where(t.Step.session_id == se.id, t.Step.status == "ok",
                                                    t.Step.eligibility == Eligibility.eligible)
                               .order_by(t.Step.seq)))
        rule = evalset.rules.get(se.task_id or "")
        if rule is None:
            evalset.unscored_held_out += len(steps)
            continue
        hashes = {h for st in steps for h in (*st.message_hashes, st.system_hash, st.tools_hash, st.output_hash) if h}
        contents = load_contents(s, se.tenant_id, hashes)
        try:
            inputs = rebuild_inputs({st.id: st for st in steps}, contents, fetch=lambda i, sid: t.get_step(s, i, sid))
        except LookupError:  # forgotten or expired content: the input cannot be rebuilt
            evalset.unscored_held_out += len(steps)
            continue
        for st in steps:
            body = chat_request(st, inputs[st.id], contents.get(st.system_hash) if st.system_hash else None,
                                contents.get(st.tools_hash) if st.tools_hash else None, "")
            request = {k: body[k] for k in ("messages", "tools") if body.get(k)}
            request["max_tokens"] = min(int(body.get("max_tokens") or max_tokens), max_tokens)
            evalset.cases.append(EvalCase(id=f"{se.external_id}#{st.seq}", tenant=se.tenant_id,
                                          source=f"held-out:{se.task_id}", request=request,
                                          evaluator=rule.evaluator, expected=rule.expected))
