"""The replay gate's evaluation set: operator suites (JSONL files) and held-out recorded sessions.

Suite files (`ATDP_EVAL_SUITES`, every `*.jsonl` in the folder), one JSON object a line:
- a **case**: `{"messages": [...chat messages...], "evaluator": NAME, "expected": ..., "tenant"?: str,
  "id"?: str, "tools"?: [...], "max_tokens"?: int}`; `tenant` defaults to the file's stem.
- a **task rule**: `{"task": TASK, "evaluator": NAME, "expected": ...}` (no messages): how to score
  held-out recorded sessions of that task (tenant and task as recorded, `X-ATDP-Task-Id`).

Held-out sessions (proxy.store.holdout: the tenant's `eval_holdout` share, 10% by default, never
trained on) that have a reward become cases: each eligible step's recorded input, rebuilt as the
replay command does. A task rule scores its task's sessions. A session whose task has no rule is
scored against its own recorded answers when it was rewarded well (its mean reward above the middle
of the tenant's reward range): the `recorded` evaluator asks a version to keep doing what was
rewarded (the same tool, valid arguments; or an answer close to the recorded text). Steps of
sessions rewarded at or below the middle with no rule are counted, not scored: what a poorly
rewarded answer should have been is not known.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import exists, func, select
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
    model: str | None = None  # the model the recorded call named (a provider route replays through it)

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


RECORDED = "recorded"  # the evaluator of held-out sessions without a task rule (proxy.evaluation.evaluators)


def add_held_out(s: Session, evalset: EvalSet, holdout: tuple[dict[str, float], float], *, max_cases: int,
                 max_tokens: int, well_rewarded: Callable[[str, float], bool]) -> None:
    """Add the held-out rewarded sessions' steps (newest sessions first) as cases, up to max_cases.
    `well_rewarded(tenant, mean reward)`: whether a session without a task rule is a reference."""
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
            mean = s.scalar(select(func.avg(t.Feedback.reward)).where(t.Feedback.session_id == se.id))
            if mean is None or not well_rewarded(se.tenant_id, float(mean)):
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
            if rule is not None:
                evaluator, expected = rule.evaluator, rule.expected
            else:  # what was rewarded: the recorded answer's text and the tools it called
                action = contents.get(st.output_hash) if st.output_hash else None
                action = action if isinstance(action, dict) else {}
                evaluator = RECORDED
                expected = {"text": action.get("text") or "",
                            "tools": [c.get("name") for c in action.get("tool_calls") or [] if isinstance(c, dict)]}
            evalset.cases.append(EvalCase(id=f"{se.external_id}#{st.seq}", tenant=se.tenant_id,
                                          source=f"held-out:{se.task_id}", request=request,
                                          evaluator=evaluator, expected=expected, model=st.model))
