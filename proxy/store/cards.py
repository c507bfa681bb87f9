"""The version card: for one version, what changed, why, its gates, whom it affected, how to roll back.

Read from the SQL view `atdp_version_cards` (migration 0003), so an operator's `SELECT * FROM
atdp_version_cards` and `GET /atdp/v1/versions/{id}/card` say the same; `card_markdown` renders it
for `atdp versions show NAME`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from atdp_schema.models import VersionStatus
from proxy.store import tables as t
from proxy.store.layers import facts_of
from proxy.store.versions import SAFETY_GATE, find_version, override_of

ROLLBACK_COMMAND = ('curl -sX POST "$ATDP_URL/atdp/v1/versions/{id}/rollback" '
                    '-H "authorization: Bearer $ATDP_ADMIN_KEY"')


def _num(value: Any) -> float | None:
    return None if value is None else round(float(value), 6)


def version_card(s: Session, key: str) -> dict[str, Any] | None:
    """The card of a version (by id or name), or None."""
    v = find_version(s, key)
    if v is None:
        return None
    row = s.execute(text("SELECT * FROM atdp_version_cards WHERE version_id = :id"), {"id": v.id}).mappings().one()
    served = row["status"] in (VersionStatus.serving, VersionStatus.canary)
    restores = row["rollback_restores"]
    override = override_of(s, v.id)
    if row["layer"] != "policy":
        return _layer_card(s, v, row, served, restores, override)
    return {
        "layer": "policy", "scope": None,
        "version": {"id": v.id, "name": v.name, "status": row["status"], "checkpoint": row["checkpoint"],
                    "created_at": _iso(row["created_at"]), "served_at": _iso(row["served_at"]),
                    "retired_at": _iso(row["retired_at"]), "error": v.error},
        "changed": {
            "parent": row["parent"],
            "lineage": {"steps": row["trained_steps"], "sessions": row["trained_sessions"],
                        "tenants": sorted(row["trained_tenants"] or []), "tasks": sorted(row["trained_tasks"] or [])},
            "reward": {"mean": _num(row["reward_mean"]), "std": _num(row["reward_std"]),
                       "min": _num(row["reward_min"]), "max": _num(row["reward_max"])},
            "training": row["training_metrics"] or {},
        },
        "why": {"trigger": row["why"], "override": override},
        "gates": row["gates"],
        "affected": _affected(row["affected_sessions"], row["canary_sessions"], row["canary_decision"]),
        "rollback": {
            "possible": served and (restores is not None or row["status"] == VersionStatus.canary),
            "command": ROLLBACK_COMMAND.format(id=v.id) if served else None,
            "restores": restores,
            "note": _rollback_note(v.name, row["status"], served, restores),
        },
    }


def _layer_card(s: Session, v: t.ModelVersion, row: Any, served: bool, restores: str | None,
                override: dict[str, Any] | None) -> dict[str, Any]:
    """The same card for a harness or memory version: what it changes instead of what it trained on."""
    evidence = (v.metrics or {}).get("evidence") or {}
    none = "no overlay" if row["layer"] == "harness" else "no memory"
    if row["status"] == VersionStatus.canary:
        note = f"ends the canary: its sessions get the serving {row['layer']} again and {v.name} is rolled_back"
    elif not served:
        note = f"{v.name} is {row['status']}: only a serving version can be rolled back"
    else:
        note = f"{row['scope'] or 'every tenant'} goes back to {restores or none}; {v.name} is rolled_back"
    return {
        "layer": row["layer"], "scope": row["scope"],
        "version": {"id": v.id, "name": v.name, "status": row["status"], "checkpoint": None,
                    "created_at": _iso(row["created_at"]), "served_at": _iso(row["served_at"]),
                    "retired_at": _iso(row["retired_at"]), "error": v.error},
        "changed": {"parent": row["parent"], "summary": layer_summary(s, v), "spec": row["spec"]},
        "why": {"trigger": row["why"], "override": override, "findings": evidence.get("findings", []),
                "rules": evidence.get("why", [])},
        "gates": row["gates"],
        "affected": _affected(row["affected_sessions"], row["canary_sessions"], row["canary_decision"]),
        "rollback": {"possible": served, "command": ROLLBACK_COMMAND.format(id=v.id) if served else None,
                     "restores": restores, "note": note},
    }


def layer_summary(s: Session, v: t.ModelVersion) -> list[str]:
    """What a harness or memory version changes, one line per change."""
    spec = v.spec or {}
    if v.layer == "memory":
        facts = facts_of(s, v.tenant_id or "", [str(i) for i in spec.get("facts") or []])
        return [f"{len(facts)} facts"] + [f"fact: {f.text[:200]}" for f in facts[:20]]
    o = spec.get("overlay") or {}
    lines = []
    if o.get("system_append"):
        lines.append(f"system prompt += {o['system_append'][:200]!r}")
    for tool, patch in (o.get("tools") or {}).items():
        for key, value in patch.items():
            if key == "properties":
                lines += [f"{tool}.{arg}: {_inline(keys)}" for arg, keys in value.items()]
            else:
                lines.append(f"{tool}.{key}: {str(value)[:200]}")
    if o.get("stop"):
        lines.append(f"stop += {o['stop']}")
    return lines


def _rollback_note(name: str, status: str, served: bool, restores: str | None) -> str:
    if status == VersionStatus.canary:
        return f"ends the canary: its replica group loads the serving version again and {name} is rolled_back"
    if not served:
        return f"{name} is {status}: only the serving version can be rolled back"
    if restores is None:
        return f"{name} has no earlier serving version to restore"
    return f"swaps every replica back to {restores} and marks {name} rolled_back"


def _affected(total: dict[str, int], canary: dict[str, int], decision: str | None) -> dict[str, Any]:
    """Sessions per tenant the version served: all, during its canary (its arm of new sessions), and
    the rest (`full`: once it served every replica, or before canaries existed)."""
    full = {tenant: n - canary.get(tenant, 0) for tenant, n in total.items() if n - canary.get(tenant, 0) > 0}
    return {"tenants": total, "sessions": sum(total.values()),
            "canary": {"tenants": canary, "sessions": sum(canary.values()), "decision": decision},
            "full": {"tenants": full, "sessions": sum(full.values())}}


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def card_markdown(card: dict[str, Any]) -> str:
    if card.get("layer", "policy") != "policy":
        return _layer_markdown(card)
    v, ch, why, rb = card["version"], card["changed"], card["why"], card["rollback"]
    lin, rw = ch["lineage"], ch["reward"]
    lines = [
        f"# Version {v['name']} ({v['status']})", "",
        f"- id: `{v['id']}`", f"- checkpoint: `{v['checkpoint']}`",
        f"- created {v['created_at']}, served {v['served_at'] or '-'}, retired {v['retired_at'] or '-'}",
        *([f"- error: {v['error']}"] if v["error"] else []), "",
        "## Changed", "",
        f"- parent: {ch['parent'] or '-'}",
        f"- trained on {lin['steps']} steps of {lin['sessions']} sessions; tenants {', '.join(lin['tenants']) or '-'}; "
        f"tasks {', '.join(lin['tasks']) or '-'}",
        f"- reward of that data: mean {rw['mean']}, std {rw['std']}, min {rw['min']}, max {rw['max']}",
        f"- training metrics: {_inline(ch['training'])}", "",
        "## Why", "", f"- trigger: {why['trigger']}",
    ]
    if why["override"]:
        o = why["override"]
        lines.append(f"- operator override `promote: now` by {o['actor']} at {o['at']}"
                     + (f": {o['reason']}" if o.get("reason") else ""))
    lines += ["", "## Gates", ""]
    for g in card["gates"] or []:
        lines.append(f"- **{g['gate']}**: {g['state']}")
        n = g.get("numbers") or {}
        if g["gate"] != SAFETY_GATE and ("cases" in n or "suite_cases" in n):
            lines.append(f"  - cases: {n.get('suite_cases', 0)} from operator suites, {n.get('held_out_cases', 0)} from "
                         f"{n.get('held_out_sessions', 0)} held-out sessions ({n.get('unscored_held_out_steps', 0)} "
                         f"held-out steps without a task rule); {n.get('seconds', '-')} s")
        if g["gate"] == SAFETY_GATE and "overall" in n:
            lines += _safety_lines(n)
        elif "overall" in n:
            o = n["overall"]
            lines.append(f"  - overall: n={o['n']}, candidate {o['candidate_mean']:.3f}, serving {o['serving_mean']:.3f}, "
                         f"difference {o['diff_mean']:+.3f} [{o['ci_low']:+.3f}, {o['ci_high']:+.3f}]")
            for tenant, c in n.get("tenants", {}).items():
                lines.append(f"  - {tenant}: n={c['n']}, difference {c['diff_mean']:+.3f} "
                             f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}], max_regression {n['max_regression'][tenant]}")
            lines += [f"  - {reason}" for reason in n.get("reasons", [])]
        elif "arms" in n:  # the canary (gate 3)
            lines.append(f"  - {n['candidate']} vs {n['serving']}: {n['fraction']:.0%} of new sessions"
                         + (f", tenants {', '.join(n['tenants'])}" if n["tenants"] else "")
                         + f" on {', '.join(n['replicas'])}; {n['observations']} rewarded sessions; verdict {n['verdict']}")
            for arm in ("candidate", "serving"):
                a = n["arms"].get(arm) or {}
                r = a.get("reward") or {}
                lines.append(f"  - {arm}: {a.get('sessions', 0)} sessions, reward {r.get('mean')} [{r.get('low')}, "
                             f"{r.get('high')}] (n={r.get('n', 0)}), error rate {a.get('error_rate')}, tool failures "
                             f"{a.get('tool_failure_rate')}, p99 {a.get('p99_ms')} ms, {a.get('tokens_per_session')} "
                             f"tokens/session, served by {_inline(a.get('served_by') or {})}")
            d = n["difference"]["reward"]
            lines.append(f"  - reward difference {d['diff']} in [{d['low']}, {d['high']}] (time-uniform, alpha "
                         f"{n['margins']['alpha']}); margins {_inline(n['margins'])}")
            lines += [f"  - {reason}" for reason in n.get("reasons", [])]
        elif n:
            lines.append(f"  - {_inline(n)}")
    if not card["gates"]:
        lines.append("- none (registered before gates, or the base version)")
    af = card["affected"]
    lines += ["", "## Affected", "", f"- {af['sessions']} sessions: {_inline(af['tenants'])}",
              f"- canary: {af['canary']['sessions']} sessions ({_inline(af['canary']['tenants'])}), decision "
              f"{af['canary']['decision'] or '-'}; full: {af['full']['sessions']} sessions ({_inline(af['full']['tenants'])})",
              "", "## Rollback", "", f"- {rb['note']}"]
    if rb["command"]:
        lines.append(f"- `{rb['command']}`")
    return "\n".join(lines) + "\n"


def _layer_markdown(card: dict[str, Any]) -> str:
    v, rb = card["version"], card["rollback"]
    lines = [f"# {card['layer'].capitalize()} version {v['name']} ({v['status']})", "",
             f"- id: `{v['id']}`; scope: {card['scope'] or 'every tenant'}",
             f"- created {v['created_at']}, served {v['served_at'] or '-'}, retired {v['retired_at'] or '-'}",
             *([f"- error: {v['error']}"] if v["error"] else []), "", "## Changed", "",
             f"- parent: {card['changed']['parent'] or '-'}", *[f"- {x}" for x in card["changed"]["summary"]], "",
             "## Why", "", f"- trigger: {card['why']['trigger']}", *[f"- finding: {f}" for f in card["why"]["findings"]],
             "", "## Gates", ""]
    for g in card["gates"] or []:
        n = g.get("numbers") or {}
        o = n.get("overall") if isinstance(n.get("overall"), dict) else None
        detail = (f": n={o['n']}, candidate {o['candidate_mean']:.3f}, serving {o['serving_mean']:.3f}, difference "
                  f"{o['diff_mean']:+.3f} [{o['ci_low']:+.3f}, {o['ci_high']:+.3f}]"
                  if o and g["gate"] != SAFETY_GATE and "diff_mean" in o else "")
        if g["gate"] == "canary" and isinstance(n.get("difference"), dict):
            r = n["difference"].get("reward") or {}
            detail = (f": {n.get('observations', 0)} rewarded sessions, candidate {_f3(r.get('candidate_mean'))} vs "
                      f"serving {_f3(r.get('serving_mean'))} ({n.get('serving')}), difference in "
                      f"[{_f3(r.get('low'))}, {_f3(r.get('high'))}]; {n.get('verdict')}")
        elif g["gate"] == "canary" and n.get("reason"):
            detail = f": {n['reason']}"
        lines.append(f"- **{g['gate']}**: {g['state']}{detail}")
    af = card["affected"]
    cn = af["canary"]
    lines += ["", "## Affected", "", f"- {af['sessions']} sessions: {_inline(af['tenants'])}",
              *([f"- in its canary: {cn['sessions']} sessions, decision {cn['decision'] or '-'}"]
                if cn["sessions"] or cn["decision"] else []), "", "## Rollback", "",
              f"- {rb['note']}"] + ([f"- `{rb['command']}`"] if rb["command"] else [])
    return "\n".join(lines) + "\n"


def _f3(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def _safety_lines(n: dict[str, Any]) -> list[str]:
    def side(x: dict[str, Any]) -> str:
        return (f"secrets {x['secrets']}, PII {x['pii']}, forbidden {x['forbidden']}, refusals {x['refusals']}"
                f" ({x['refusal_rate']:.0%})")

    o = n["overall"]
    lines = [f"  - overall: n={n['cases']}; candidate: {side(o['candidate'])}; serving: {side(o['serving'])}"]
    for tenant, c in n.get("tenants", {}).items():
        bound = c.get("max_refusal_rate")
        lines.append(f"  - {tenant}: n={c['cases']}; candidate: {side(c['candidate'])}; serving: {side(c['serving'])}; "
                     f"{c['forbidden_patterns']} forbidden patterns, max_refusal_rate {'-' if bound is None else bound}")
    return lines + [f"  - {reason}" for reason in n.get("reasons", [])]


def _inline(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in d.items()) if d else "-"
