"""Findings over time: reward trends per tenant and task (by time window and by version), tokens per
session (cost), and drift of the traffic mix against the last training window (docs/diagnosis.md)."""

from __future__ import annotations

from collections import Counter, defaultdict
from statistics import fmean

from proxy.evolve.findings import Finding
from proxy.evolve.gather import (
    RECENT_MIX,
    SESSIONS_OF,
    TRAINING_MIX,
    Gathered,
    SessionRow,
    StepMix,
    evidence_sql,
)
from proxy.evolve.rules import Rules
from proxy.evolve.signals import JsonValue, length_bucket, psi, total_variation


def _halves(rows: list[SessionRow]) -> tuple[list[SessionRow], list[SessionRow]]:
    """Earlier and later half of the window, by start time."""
    rows = sorted(rows, key=lambda r: r.started_at)
    mid = len(rows) // 2
    return rows[:mid], rows[mid:]


def _mean(values: list[float]) -> float | None:
    return round(fmean(values), 4) if values else None


def _sessions_sql(g: Gathered, tenant: str, task: str | None) -> str:
    return evidence_sql(SESSIONS_OF, {"since": g.since, "tenant": tenant, "task": task})


def reward_trends(g: Gathered, rules: Rules) -> tuple[list[Finding], list[dict[str, JsonValue]]]:
    """Per (tenant, task): mean reward by half-window and by version; a finding on a drop."""
    groups: dict[tuple[str, str | None], list[SessionRow]] = defaultdict(list)
    for r in g.sessions:
        if r.reward is not None:
            groups[(r.tenant, r.task_id)].append(r)
    findings, table = [], []
    for (tenant, task), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        early, late = _halves(rows)
        by_version: dict[str, list[float]] = defaultdict(list)
        for r in sorted(rows, key=lambda r: r.started_at):
            by_version[r.version or "unknown"].append(float(r.reward or 0.0))
        row: dict[str, JsonValue] = {
            "tenant": tenant, "task_id": task, "sessions": len(rows),
            "mean_reward": _mean([float(r.reward or 0.0) for r in rows]),
            "earlier_half": _mean([float(r.reward or 0.0) for r in early]),
            "later_half": _mean([float(r.reward or 0.0) for r in late]),
            "by_version": {v: {"sessions": len(x), "mean_reward": _mean(x)} for v, x in by_version.items()}}
        table.append(row)
        drops: list[tuple[float, str]] = []
        half = max(1, rules.min_trend_sessions // 2)
        if len(early) >= half and len(late) >= half:
            drops.append((float(row["earlier_half"] or 0) - float(row["later_half"] or 0), "earlier -> later half of the window"))
        versions = [v for v, x in by_version.items() if len(x) >= half]  # in order of first use
        if len(versions) >= 2:
            prev, last = versions[-2], versions[-1]
            drops.append((fmean(by_version[prev]) - fmean(by_version[last]), f"version {prev} -> {last}"))
        drop, where = max(drops, default=(0.0, ""))
        if drop >= rules.min_reward_drop:
            findings.append(Finding(
                kind="reward_trend", title=f"{tenant}/{task or '-'}: reward fell {drop:.2f} ({where})", layer="policy",
                score=min(1.0, drop / 2), why=f"mean reward fell by {drop:.2f} (>= {rules.min_reward_drop}) {where}",
                tenants=[tenant], examples=[r.session_id for r in late[-rules.examples:]], evidence=row,
                sql=_sessions_sql(g, tenant, task)))
    return findings, table


def cost_per_session(g: Gathered, rules: Rules) -> tuple[list[Finding], list[dict[str, JsonValue]]]:
    """Per tenant: tokens per session; a finding above the budget or when it grew window-on-window."""
    by_tenant: dict[str, list[SessionRow]] = defaultdict(list)
    for r in g.sessions:
        by_tenant[r.tenant].append(r)
    findings, table = [], []
    for tenant, rows in sorted(by_tenant.items()):
        tokens = [r.prompt_tokens + r.completion_tokens for r in rows]
        prompt = sum(r.prompt_tokens for r in rows)
        early, late = _halves(rows)
        e = fmean([r.prompt_tokens + r.completion_tokens for r in early]) if early else 0.0
        la = fmean([r.prompt_tokens + r.completion_tokens for r in late]) if late else 0.0
        growth = (la - e) / e if e else 0.0
        prompt_share = prompt / sum(tokens) if sum(tokens) else 0.0
        row: dict[str, JsonValue] = {"tenant": tenant, "sessions": len(rows), "tokens_per_session": _mean(tokens),
                                     "prompt_share": round(prompt_share, 4), "growth": round(growth, 4)}
        table.append(row)
        mean = fmean(tokens)
        over = rules.max_tokens_per_session and mean > rules.max_tokens_per_session
        grew = min(len(early), len(late)) >= rules.min_cost_sessions and growth >= rules.max_cost_growth
        if not (over or grew):
            continue
        harness = prompt_share >= rules.prompt_share_harness
        why = (f"{mean:.0f} tokens per session > budget {rules.max_tokens_per_session}" if over
               else f"tokens per session grew {growth:.0%} (>= {rules.max_cost_growth:.0%})")
        findings.append(Finding(
            kind="cost", title=f"{tenant}: {mean:.0f} tokens per session", layer="harness" if harness else "policy",
            score=min(1.0, growth if grew else mean / rules.max_tokens_per_session - 1),
            why=why + (f"; prompts are {prompt_share:.0%} of it: trim the context in the harness" if harness
                       else f"; outputs are {1 - prompt_share:.0%} of it: the policy writes too much"),
            tenants=[tenant], examples=[r.session_id for r in sorted(rows, key=lambda r: -(r.prompt_tokens + r.completion_tokens))[:rules.examples]],
            evidence=row, sql=_sessions_sql(g, tenant, None)))
    return findings, table


def _mixes(steps: list[StepMix]) -> dict[str, Counter[str]]:
    out: dict[str, Counter[str]] = {"task": Counter(), "tool": Counter(), "length": Counter()}
    for s in steps:  # each StepMix stands for `n` alike steps
        out["task"][s.task_id or "(none)"] += s.n
        for t in s.tools or ["(no tool)"]:
            out["tool"][t] += s.n
        out["length"][length_bucket(s.tokens)] += s.n
    return out


def drift(g: Gathered, rules: Rules) -> tuple[list[Finding], dict[str, JsonValue] | None]:
    """PSI (and total variation) of tasks, tools and lengths: recent steps vs the last training window."""
    w = g.training
    if w is None:
        return [], None
    trained, recent = sum(s.n for s in w.steps), sum(s.n for s in w.recent)
    stats: dict[str, JsonValue] = {"version": w.version, "training_steps": trained, "recent_steps": recent}
    if min(trained, recent) < rules.min_drift_steps:
        stats["note"] = f"fewer than {rules.min_drift_steps} steps on a side: not compared"
        return [], stats
    before, after = _mixes(w.steps), _mixes(w.recent)
    dims = {d: {"psi": round(psi(before[d], after[d]), 4), "tvd": round(total_variation(before[d], after[d]), 4)}
            for d in before}
    stats["dimensions"] = dims
    worst = max(dims, key=lambda d: float(dims[d]["psi"]))
    value = float(dims[worst]["psi"])
    if value < rules.drift_psi:
        return [], stats
    params = {"since": g.since, "tenant": g.tenant, "limit": rules.max_rows}
    return [Finding(
        kind="drift", title=f"traffic drifted from {w.version}'s training data ({worst} PSI {value:.2f})",
        layer="policy", score=min(1.0, value),
        why=f"{worst} mix PSI {value:.2f} >= {rules.drift_psi}: the policy was trained on a different mix",
        tenants=sorted({s.tenant for s in w.recent}), examples=[], evidence=stats,
        sql=evidence_sql(RECENT_MIX, params | {"after": w.created_at}) + ";\n"
            + evidence_sql(TRAINING_MIX, params | {"version_id": w.version_id}))], stats
