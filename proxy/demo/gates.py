"""The demo's gates: what each trained candidate is evaluated on before it may serve, and its card.

The trainer never sees the evaluation set:
- **held-out sessions**: the demo tenant's policy holds out `eval_holdout` of its sessions (by hash of
  tenant, task and session id, proxy.store.holdout); the trainer's lease skips them, the replay gate
  replays their recorded prompts. Each round's tasks get a task rule in the operator suite, so the
  held-out sessions of that round are scored;
- **an operator suite** (`ATDP_EVAL_SUITES`, one file `demo.jsonl`): a fixed set of prompts of the
  same family, none of them a task of any round (the rounds' tasks are known in advance), never sent
  through the proxy.

Both are scored per step by the task's own correctness rule (proxy.demo.skill) as a replay-gate
evaluator, `proxy.demo.gates:score`: a turn-1 step (the question) scores 1 if the reply calls
lookup(...) on the task's item, a turn-2 step (the tool's result came back) scores 1 if the reply
reports the code; everything else 0. The gate replays greedily (temperature 0), so it measures the
versions' greedy answers, not the sampled ones the live rewards come from. (The per-version held-out
success that the demo reports is a separate, whole-attempt evaluation: proxy.demo.agent.evaluate.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.demo.skill import Task, make_tasks, parse_call, reports_code, tool_result
from proxy.evaluation.cases import Answer, EvalCase

EVALUATOR = "proxy.demo.gates:score"
SUITE = "demo.jsonl"  # the file's stem is the suite cases' tenant: the demo's own
EVAL_ROUND = 900  # the suite's tasks: round numbers the rounds never reach


def score(case: EvalCase, answer: Answer) -> float:
    """One replayed step of a lookup task; `expected` is `{"item": str, "code": int}`. A step whose
    last message is the tool's result is turn 2 (report the code), any other is turn 1 (call the tool)."""
    expected = case.expected
    if not isinstance(expected, dict) or not isinstance(expected.get("item"), str) \
            or not isinstance(expected.get("code"), int):
        raise ValueError(f"case {case.id}: expected must be {{'item': str, 'code': int}}")
    messages = case.request.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "user" and str(last.get("content") or "").startswith("lookup("):
        return float(reports_code(answer.text, expected["code"], truncated=answer.finish_reason == "length"))
    return float(parse_call(answer.text) == expected["item"])


def _turns(task: Task) -> list[list[dict[str, str]]]:
    """The two steps of a solved attempt at the task: the question, and the tool's result after the call."""
    call = f'lookup("{task.item}")'
    return [task.messages(), [*task.messages(), {"role": "assistant", "content": call},
                              {"role": "user", "content": tool_result(task.item)}]]


@dataclass
class EvalSuite:
    """The operator suite file: fixed cases, plus a task rule per round task (rewritten whole each time)."""

    folder: Path
    cases: list[Task]
    max_tokens: int
    rules: list[Task] = field(default_factory=list)
    n_cases: int = 0

    @classmethod
    def create(cls, folder: Path, *, n_cases: int, seed: int, max_tokens: int, exclude: Iterable[Task] = ()) -> EvalSuite:
        """`n_cases` steps (both turns of (n_cases + 1) // 2 training-split items), none of them an item
        of a task in `exclude` (the rounds' tasks)."""
        taken = {task.item for task in exclude}
        pool = [task for task in make_tasks(400, seed=seed, round_no=EVAL_ROUND) if task.item not in taken]
        suite = cls(folder, pool[:(n_cases + 1) // 2], max_tokens, n_cases=n_cases)
        suite.write()
        return suite

    def add_rules(self, tasks: list[Task]) -> None:
        self.rules += tasks
        self.write()

    def write(self) -> None:
        lines = [{"id": f"{task.id}-t{turn + 1}", "messages": messages, "evaluator": EVALUATOR,
                  "expected": {"item": task.item, "code": task.code}, "max_tokens": self.max_tokens}
                 for task in self.cases for turn, messages in enumerate(_turns(task))][:self.n_cases]
        lines += [{"task": task.id, "evaluator": EVALUATOR, "expected": {"item": task.item, "code": task.code}}
                  for task in self.rules]
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / (SUITE + ".tmp")  # not *.jsonl: never read half-written
        tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))
        os.replace(tmp, self.folder / SUITE)


def set_policy(proxy_url: str, admin_key: str, tenant: str, changes: dict[str, Any]) -> None:
    import httpx

    r = httpx.put(f"{proxy_url}/atdp/v1/tenants/{tenant}/policy", json=changes,
                  headers={"authorization": f"Bearer {admin_key}"}, timeout=30.0, trust_env=False)
    if r.status_code != 200:
        raise RuntimeError(f"setting the {tenant} policy {changes}: {r.status_code} {r.text[:300]}")


def held_out_count(url: str, tenant: str, share: float, session_ids: list[str]) -> int:
    """How many of these sessions (external ids) the holdout keeps from the trainer."""
    from sqlalchemy import func, select

    from proxy.store import db
    from proxy.store import tables as t
    from proxy.store.holdout import held_out_sql

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        with db.session_factory(engine)() as s:
            return s.scalar(select(func.count()).select_from(t.Session).where(
                t.Session.tenant_id == tenant, t.Session.external_id.in_(session_ids),
                held_out_sql({tenant: share}, 0.0))) or 0
    finally:
        engine.dispose()


def read_card(url: str, name: str) -> dict[str, Any] | None:
    """The version's card, as `atdp versions show NAME --json` prints it."""
    from proxy.store import db
    from proxy.store.cards import version_card

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        with db.session_factory(engine)() as s:
            return version_card(s, name)
    finally:
        engine.dispose()


def last_promoted(url: str) -> str | None:
    """The newest trained version that reached serving (serving now, or served and retired since)."""
    from sqlalchemy import select

    from proxy.store import db
    from proxy.store import tables as t

    engine = db.make_engine(url, pool_size=1, max_overflow=0)
    try:
        with db.session_factory(engine)() as s:
            return s.scalars(select(t.ModelVersion.name).where(t.ModelVersion.parent_id.is_not(None),
                                                               t.ModelVersion.layer == "policy",
                                                               t.ModelVersion.served_at.is_not(None))
                             .order_by(t.ModelVersion.served_at.desc()).limit(1)).first()
    finally:
        engine.dispose()


@dataclass
class GateRound:
    """One candidate's gate outcome, as the board shows it."""

    version: str
    status: str
    replay: dict[str, Any]  # the replay gate's state and numbers
    safety: dict[str, Any]
    canary: dict[str, Any] | None
    seconds: float | None
    error: str | None = None

    @classmethod
    def from_card(cls, card: dict[str, Any]) -> GateRound:
        gates = {g["gate"]: g for g in card.get("gates") or []}
        replay = gates.get("replay_eval") or {}
        return cls(version=card["version"]["name"], status=card["version"]["status"], replay=replay,
                   safety=gates.get("safety") or {}, canary=gates.get("canary"),
                   seconds=(replay.get("numbers") or {}).get("seconds"), error=card["version"].get("error"))

    def lines(self) -> list[str]:
        n = self.replay.get("numbers") or {}
        out = []
        if "overall" in n:
            o = n["overall"]
            out.append(f"replay [{self.replay['state']}]: {n['cases']} cases ({n.get('suite_cases', 0)} suite, "
                       f"{n.get('held_out_cases', 0)} held-out), candidate {o['candidate_mean']:.3f} vs serving "
                       f"{o['serving_mean']:.3f}, difference {o['diff_mean']:+.3f} [{o['ci_low']:+.3f}, "
                       f"{o['ci_high']:+.3f}], {n.get('seconds', '-')} s")
        else:
            out.append(f"replay [{self.replay.get('state', '-')}]: {n.get('reason') or n.get('error') or n}")
        sn = self.safety.get("numbers") or {}
        if "overall" in sn:
            c, s = sn["overall"]["candidate"], sn["overall"]["serving"]
            out.append(f"safety [{self.safety['state']}]: candidate / serving: secrets {c['secrets']}/{s['secrets']}, "
                       f"PII {c['pii']}/{s['pii']}, forbidden {c['forbidden']}/{s['forbidden']}, "
                       f"refusals {c['refusals']}/{s['refusals']}")
        else:
            out.append(f"safety [{self.safety.get('state', '-')}]: {sn.get('reason') or sn.get('error') or sn}")
        if self.canary is not None:
            cn = self.canary.get("numbers") or {}
            out.append(f"canary [{self.canary['state']}]: {cn.get('reason') or cn.get('verdict') or cn}")
        return out

    def as_dict(self) -> dict[str, Any]:
        n = self.replay.get("numbers") or {}
        sn = self.safety.get("numbers") or {}
        return {"version": self.version, "status": self.status, "replay_state": self.replay.get("state"),
                "replay_overall": n.get("overall"), "cases": n.get("cases"), "suite_cases": n.get("suite_cases"),
                "held_out_cases": n.get("held_out_cases"), "gate_seconds": self.seconds,
                "safety_state": self.safety.get("state"), "safety_overall": sn.get("overall"),
                "canary_state": (self.canary or {}).get("state"), "error": self.error}


def card_fields_filled(card: dict[str, Any]) -> dict[str, bool]:
    """Whether each section of the card carries data from the run (the demo prints it; the test asserts it)."""
    ch, af, rb = card["changed"], card["affected"], card["rollback"]
    gates = {g["gate"]: g for g in card.get("gates") or []}
    return {
        "changed": bool(ch["parent"]) and (ch["lineage"]["steps"] or 0) > 0 and ch["reward"]["mean"] is not None
        and bool(ch["training"]),
        "why": bool(card["why"]["trigger"]),
        "gates": all(gates.get(g, {}).get("state") == "passed" and (gates[g].get("numbers") or {}).get("overall")
                     for g in ("replay_eval", "safety")),
        "affected": (af["sessions"] or 0) > 0,
        "rollback": bool(rb["command"]) and bool(rb["restores"]),
    }


def final_card(url: str, out: Path) -> tuple[str | None, str, dict[str, Any] | None]:
    """The last promoted version's card: written to out/card.md and out/card.json; (name, Markdown, card)."""
    from proxy.store.cards import card_markdown

    name = last_promoted(url)
    card = read_card(url, name) if name else None
    if card is None:
        text = "no trained version was promoted in this run (every candidate was rejected, or waits for evaluation cases): no card to show\n"
        (out / "card.md").write_text(text)
        return None, text, None
    text = card_markdown(card)
    (out / "card.md").write_text(text)
    (out / "card.json").write_text(json.dumps(card, indent=1, default=str) + "\n")
    return name, text, card


def serving_version(proxy_url: str, admin_key: str) -> str | None:
    """The weight version the proxy serves, or None while it cannot say."""
    import httpx

    try:
        r = httpx.get(proxy_url + "/atdp/v1/versions", headers={"authorization": f"Bearer {admin_key}"},
                      timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return None
    return r.json().get("serving") if r.status_code == 200 else None
