"""Findings from tool use and corrections: failure clusters, spread failures, argument schema
violations, user corrections. Each rule is one plain function over gathered rows (docs/diagnosis.md).

A finding's `score` is the share of the diagnosed sessions it touches (0-1), so findings of different
kinds rank on one scale: the fix that reaches the most traffic first.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.evolve.gather import (
    ALL_TOOL_FAILURES,
    CORRECTIONS,
    TOOL_CALLS_OF,
    TOOL_FAILURES_OF,
    Correction,
    Gathered,
    ToolUse,
    evidence_sql,
)
from proxy.evolve.rules import Rules
from proxy.evolve.signals import JsonValue, argument_violations, error_signature, supplies_facts
from proxy.evolve.signals import tool_schemas as declared_schemas


@dataclass
class Finding:
    kind: str  # tool_failure_cluster | spread_failures | schema_violation | corrections | reward_trend | cost | drift
    title: str
    layer: str  # harness | memory | policy
    score: float  # share of the diagnosed sessions touched (drift, trends: their own 0-1 scale)
    why: str  # the rule that fired, with its threshold
    tenants: list[str]
    examples: list[str]  # example session ids
    evidence: dict[str, JsonValue]
    sql: str  # reproduces the rows counted

    def to_dict(self) -> dict[str, JsonValue]:
        return {"kind": self.kind, "title": self.title, "layer": self.layer, "score": round(self.score, 4),
                "why": self.why, "tenants": list(self.tenants), "examples": list(self.examples),
                "evidence": self.evidence, "sql": self.sql}


def _params(g: Gathered, **extra: object) -> dict[str, object]:
    return {"since": g.since, "tenant": g.tenant, **extra}


def _examples(session_ids: list[str], n: int) -> list[str]:
    return list(dict.fromkeys(session_ids))[:n]


def _share(sessions: set[str], total: int) -> float:
    return len(sessions) / total if total else 0.0


@dataclass
class ToolStats:
    """Per tool: calls whose result came back, and those marked as errors."""

    answered: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)

    def rate(self, tool: str) -> float:
        return self.failures[tool] / self.answered[tool] if self.answered[tool] else 0.0


def _count(uses: list[ToolUse]) -> int:
    return sum(u.n for u in uses)


def concentrated_tools(stats: ToolStats, rules: Rules) -> set[str]:
    """Tools that hold `concentration_share` of all failures and fail at `min_failure_rate` or more."""
    total = sum(stats.failures.values())
    return {tool for tool, n in stats.failures.items()
            if total and n >= rules.min_failures and n / total >= rules.concentration_share
            and stats.rate(tool) >= rules.min_failure_rate}


def tool_failure_findings(g: Gathered, rules: Rules, total_sessions: int) -> list[Finding]:
    failures = g.failures
    stats = ToolStats(answered=g.tool_counts.answered, failures=g.tool_counts.failures)
    focus = concentrated_tools(stats, rules)
    clusters: dict[tuple[str, str], list[ToolUse]] = defaultdict(list)
    signatures: dict[str, str] = {}  # result text -> signature: many failures share one text
    for u in failures:
        if u.result not in signatures:
            signatures[u.result] = error_signature(u.result)
        clusters[(u.tool, signatures[u.result])].append(u)
    out = []
    total_failures = _count(failures)
    for (tool, signature), uses in clusters.items():
        if _count(uses) < rules.min_failures:
            continue
        harness = tool in focus
        sessions = {u.session_id for u in uses}
        out.append(Finding(
            kind="tool_failure_cluster", title=f"{tool}: {signature}",
            layer="harness" if harness else "policy", score=_share(sessions, total_sessions),
            why=(f"{tool} holds {stats.failures[tool]}/{total_failures} tool failures (>= {rules.concentration_share:.0%})"
                 f" and fails {stats.rate(tool):.0%} of its calls (>= {rules.min_failure_rate:.0%}): fix the tool or"
                 " its schema" if harness else
                 f"no tool holds {rules.concentration_share:.0%} of the failures: part of a spread"),
            tenants=sorted({u.tenant for u in uses}), examples=_examples([u.session_id for u in uses], rules.examples),
            evidence={"tool": tool, "signature": signature, "failures": _count(uses), "sessions": len(sessions),
                      "tool_failures": stats.failures[tool], "tool_results": stats.answered[tool],
                      "tool_failure_rate": round(stats.rate(tool), 4),
                      "tasks": sorted({u.task_id or "" for u in uses})},
            sql=evidence_sql(TOOL_FAILURES_OF, _params(g, tool=tool))))
    spread = spread_finding(g, rules, failures, stats, focus, total_sessions)
    return out + ([spread] if spread else [])


def spread_finding(g: Gathered, rules: Rules, failures: list[ToolUse], stats: ToolStats, focus: set[str],
                   total_sessions: int) -> Finding | None:
    """Failures over many tools, tasks and tenants with none concentrated: the model, not one tool."""
    tools = {u.tool for u in failures}
    tasks = {u.task_id or "" for u in failures}
    tenants = {u.tenant for u in failures}
    if (focus or _count(failures) < rules.min_failures or len(tools) < rules.spread_min_tools
            or len(tasks) < rules.spread_min_tasks or len(tenants) < rules.spread_min_tenants):
        return None
    sessions = {u.session_id for u in failures}
    return Finding(
        kind="spread_failures", title=f"tool failures spread over {len(tools)} tools, {len(tasks)} tasks, "
                                      f"{len(tenants)} tenants",
        layer="policy", score=_share(sessions, total_sessions),
        why=(f">= {rules.spread_min_tools} tools, {rules.spread_min_tasks} tasks and {rules.spread_min_tenants} "
             f"tenants fail and no tool holds {rules.concentration_share:.0%} of the failures: update the policy"),
        tenants=sorted(tenants), examples=_examples([u.session_id for u in failures], rules.examples),
        evidence={"failures": _count(failures), "sessions": len(sessions),
                  "by_tool": {t: stats.failures[t] for t in sorted(tools)},
                  "by_task": dict(sorted(_weighted(failures, lambda u: u.task_id or "").items())),
                  "by_tenant": dict(sorted(_weighted(failures, lambda u: u.tenant).items()))},
        sql=evidence_sql(ALL_TOOL_FAILURES, _params(g)))


def _weighted(uses: list[ToolUse], key: Callable[[ToolUse], str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for u in uses:
        out[key(u)] += u.n
    return out


def schema_findings(g: Gathered, rules: Rules, total_sessions: int) -> list[Finding]:
    """Tool calls whose arguments break the JSON schema the agent declared for that tool (checked
    here, from the stored arguments and tool schema, not at capture time)."""
    hits: dict[tuple[str, str, str], list[ToolUse]] = defaultdict(list)
    checked: Counter[str] = Counter()
    declared: dict[tuple[str, str] | None, dict[str, dict[str, JsonValue]]] = {}  # per tools list, parsed once
    verdicts: dict[tuple[object, ...], list[tuple[str, str]]] = {}  # per schema and arguments, checked once
    for u in g.checked:
        if u.schema_key not in declared:
            declared[u.schema_key] = declared_schemas(u.schema)
        schema = declared[u.schema_key].get(u.tool)
        if schema is None:
            continue
        checked[u.tool] += u.n
        key = (u.schema_key, u.tool, json.dumps(u.arguments, sort_keys=True))
        if key not in verdicts:
            verdicts[key] = argument_violations(u.arguments, schema)
        for path, problem in verdicts[key]:
            hits[(u.tool, path, problem)].append(u)
    out = []
    for (tool, path, problem), uses in hits.items():
        if _count(uses) < rules.min_schema_violations:
            continue
        sessions = {u.session_id for u in uses}
        out.append(Finding(
            kind="schema_violation", title=f"{tool} {path}: {problem}", layer="harness",
            score=_share(sessions, total_sessions),
            why=f"{_count(uses)} calls of {tool} break its declared schema at {path} (>= {rules.min_schema_violations}):"
                " clarify the tool schema or validate in the harness",
            tenants=sorted({u.tenant for u in uses}), examples=_examples([u.session_id for u in uses], rules.examples),
            evidence={"tool": tool, "argument": path, "problem": problem, "violations": _count(uses),
                      "calls_checked": checked[tool], "sessions": len(sessions)},
            sql=evidence_sql(TOOL_CALLS_OF, _params(g, tool=tool))))
    return out


def correction_stats(corrections: list[Correction], sessions_by_tenant: Counter[str]) -> dict[str, dict[str, JsonValue]]:
    by_tenant: dict[str, list[Correction]] = defaultdict(list)
    for c in corrections:
        by_tenant[c.tenant].append(c)
    out: dict[str, dict[str, JsonValue]] = {}
    for tenant, total in sorted(sessions_by_tenant.items()):
        cs = by_tenant.get(tenant, [])
        corrected = len({c.session_id for c in cs})
        out[tenant] = {"sessions": total, "corrected_sessions": corrected, "corrections": len(cs),
                       "correction_rate": round(corrected / total, 4) if total else 0.0,
                       "supply_facts": sum(supplies_facts(c.text) for c in cs)}
    return out


def correction_findings(g: Gathered, rules: Rules, total_sessions: int) -> tuple[list[Finding], dict[str, dict[str, JsonValue]]]:
    """Per tenant: a correction rate above the rule; memory when most corrections supply facts."""
    stats = correction_stats(g.corrections, Counter(s.tenant for s in g.sessions))
    out = []
    for tenant, st in stats.items():
        n = int(st["corrections"] or 0)
        rate = float(st["correction_rate"] or 0.0)
        if n < rules.min_corrections or rate < rules.min_correction_rate:
            continue
        cs = [c for c in g.corrections if c.tenant == tenant]
        facts = [c for c in cs if supplies_facts(c.text)]
        memory = len(facts) / n >= rules.fact_share
        sessions = {c.session_id for c in cs}
        out.append(Finding(
            kind="corrections", title=f"{tenant}: {rate:.0%} of sessions corrected by users",
            layer="memory" if memory else "policy", score=_share(sessions, total_sessions),
            why=(f"{len(facts)}/{n} corrections supply facts (>= {rules.fact_share:.0%}): give the agent memory of them"
                 if memory else f"only {len(facts)}/{n} corrections supply facts (< {rules.fact_share:.0%}): they ask "
                 "for different behaviour, a policy update"),
            tenants=[tenant], examples=_examples([c.session_id for c in (facts or cs)], rules.examples),
            evidence={**st, "tasks": sorted({c.task_id or "" for c in cs}),
                      "fact_examples": [c.text[:200] for c in facts[: rules.examples]]},
            sql=evidence_sql(CORRECTIONS, {"since": g.since, "tenant": tenant, "limit": rules.max_rows})))
    return out, stats
