"""Diagnosis: where to fix. Turns the store into ranked findings, each with evidence (counts, example
sessions, the SQL that reproduces it), the tenants it touches and a recommended layer:

- **harness**: failures concentrated on one tool or argument (fix the tool, its schema, the harness);
- **memory**: corrections that supply facts the agent could not know (give it memory);
- **policy**: failures spread across tenants, tasks and tools, reward declines, drift (train).

Used by `atdp diagnose`, `GET /atdp/v1/diagnosis` and `atdp train --when diagnosed`. Rules and
thresholds: proxy.evolve.rules, docs/diagnosis.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from proxy.evolve.findings import Finding, correction_findings, schema_findings, tool_failure_findings
from proxy.evolve.gather import gather
from proxy.evolve.rules import LAYERS, Rules
from proxy.evolve.signals import JsonValue
from proxy.evolve.trends import cost_per_session, drift, reward_trends


@dataclass
class Diagnosis:
    generated_at: datetime
    since: datetime
    tenant: str | None  # None: every tenant
    rules: Rules
    sessions: int
    findings: list[Finding]  # ranked, highest score first
    stats: dict[str, JsonValue]

    @property
    def recommendation(self) -> str | None:
        """The layer of the top-ranked finding (None: nothing to fix)."""
        return self.findings[0].layer if self.findings else None

    def recommends(self, layer: str) -> bool:
        return any(f.layer == layer for f in self.findings)

    def to_dict(self) -> dict[str, JsonValue]:
        layers: dict[str, JsonValue] = {
            layer: {"findings": sum(f.layer == layer for f in self.findings),
                    "top_score": round(max((f.score for f in self.findings if f.layer == layer), default=0.0), 4)}
            for layer in LAYERS}
        return {"generated_at": self.generated_at.isoformat(), "since": self.since.isoformat(),
                "tenant": self.tenant, "sessions": self.sessions, "recommendation": self.recommendation,
                "layers": layers, "findings": [f.to_dict() for f in self.findings], "stats": self.stats,
                "rules": {k: v for k, v in asdict(self.rules).items()}}


def diagnose(s: Session, rules: Rules, *, tenant: str | None = None, now: datetime | None = None,
             reference: bool = False) -> Diagnosis:
    """Read the window's traffic (one tenant, or all) and apply every rule; findings ranked by score.
    `reference`: count every row in Python instead of grouping in PostgreSQL (same findings, slower)."""
    now = now or datetime.now(UTC)
    since = now - timedelta(days=rules.window_days)
    g = gather(s, since=since, tenant=tenant, limit=rules.max_rows, reference=reference)
    total = len({(r.tenant, r.session_id) for r in g.sessions})
    findings = tool_failure_findings(g, rules, total) + schema_findings(g, rules, total)
    corrections, correction_table = correction_findings(g, rules, total)
    rewards, reward_table = reward_trends(g, rules)
    costs, cost_table = cost_per_session(g, rules)
    drifted, drift_stats = drift(g, rules)
    findings += corrections + rewards + costs + drifted
    findings.sort(key=lambda f: (-f.score, LAYERS.index(f.layer), f.kind, f.title))
    counts = g.tool_counts
    stats: dict[str, JsonValue] = {
        "tool_calls": sum(counts.calls.values()), "tool_results": sum(counts.answered.values()),
        "tool_failures": sum(counts.failures.values()),
        "corrections": correction_table, "rewards": reward_table, "cost": cost_table, "drift": drift_stats}
    return Diagnosis(generated_at=now, since=since, tenant=tenant, rules=rules, sessions=total, findings=findings,
                     stats=stats)


def render_table(d: Diagnosis) -> str:
    """A readable table of the ranked findings, for a terminal."""
    head = (f"diagnosis of {d.sessions} sessions since {d.since:%Y-%m-%d %H:%M} UTC"
            f" ({d.tenant or 'all tenants'}): recommendation {d.recommendation or 'none (nothing to fix)'}")
    if not d.findings:
        return head + "\n"
    rows = [("#", "layer", "score", "kind", "finding", "tenants", "examples")]
    for i, f in enumerate(d.findings, 1):
        rows.append((str(i), f.layer, f"{f.score:.2f}", f.kind, f.title[:70], ",".join(f.tenants)[:30],
                     ",".join(f.examples[:2])[:40]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    why = [f"{i}. {f.why}" for i, f in enumerate(d.findings, 1)]
    return "\n".join([head, "", *lines, "", "why:", *why]) + "\n"
