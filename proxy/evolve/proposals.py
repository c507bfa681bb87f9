"""Proposals: a diagnosis's `harness` and `memory` findings turned into candidate versions (docs/diagnosis.md).

Pure: from the gathered rows and the findings, what each candidate would change. A proposal is never
served: it is registered as a candidate and goes through the gates like any version.

- `schema_violation` (harness): the violated argument's schema gets its constraint spelled out in its
  description (the model reads descriptions; many models ignore a bare `enum`), and the tool's
  description says which argument to check. The constraint is read from the tool's declared schema.
- `tool_failure_cluster` on a tool that holds most failures (harness): the tool's description names the
  failure the calls keep meeting, so the model checks for it first.
- `corrections` whose corrections supply facts (memory): each such correction becomes a fact of the
  tenant's memory (its text is the feedback's, redacted when it was posted), its sessions and feedback
  the fact's source (a forget of those sessions deletes it).

One harness proposal per scope (the tenant when a finding has one, else every tenant), merging its
findings; one memory proposal per tenant.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from proxy.evolve.findings import Finding
from proxy.evolve.gather import Gathered
from proxy.evolve.signals import JsonValue, supplies_facts, tool_schemas

MAX_FACTS = 200  # per proposal: the newest fact-supplying corrections


@dataclass
class Proposal:
    layer: str  # harness | memory
    tenant: str | None  # scope (None: every tenant)
    spec: dict[str, JsonValue]  # harness: {"overlay": ...}; memory: {"facts": [...]} filled when registered
    facts: list[tuple[str, dict[str, JsonValue]]] = field(default_factory=list)  # memory: (text, source)
    findings: list[str] = field(default_factory=list)  # the titles of the findings it answers
    why: list[str] = field(default_factory=list)


def constraint_text(problem: str, schema: dict[str, JsonValue] | None) -> str:
    """A sentence stating what the argument's schema requires, for the keyword that was violated."""
    schema = schema or {}
    value = schema.get(problem)
    if problem == "enum" and isinstance(value, list):
        return "Must be exactly one of: " + ", ".join(json.dumps(v) for v in value) + "."
    if problem == "type" and value is not None:
        return f"Must be a JSON {value if isinstance(value, str) else ' or '.join(map(str, value))}."
    if problem == "required":
        return "Required: always pass this argument."
    if problem == "pattern" and isinstance(value, str):
        return f"Must match the regular expression {value}."
    if problem in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
                   "minItems", "maxItems") and value is not None:
        op = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}.get(problem)
        return f"Must be {op} {value}." if op else f"{problem}: {value}."
    if problem == "format" and value is not None:
        return f"Must be in the {value} format."
    if problem == "additionalProperties":
        return "Pass only the arguments the schema declares."
    return f"Must satisfy the schema's `{problem}`" + (f" ({json.dumps(value)})." if value is not None else ".")


def _argument(path: str) -> str | None:
    """`$.unit` -> `unit`; deeper paths are not patched (their schema is nested)."""
    name = path[2:] if path.startswith("$.") else None
    return name if name and "." not in name and "[" not in name else None


def _declared(g: Gathered, tool: str) -> dict[str, JsonValue] | None:
    for u in g.checked:
        if u.tool == tool and u.schema is not None:
            schema = tool_schemas(u.schema).get(tool)
            if schema is not None:
                return schema
    return None


def _scope(f: Finding) -> str | None:
    return f.tenants[0] if len(f.tenants) == 1 else None


def propose(g: Gathered, findings: list[Finding]) -> list[Proposal]:
    harness: dict[str | None, Proposal] = {}
    memory: dict[str, Proposal] = {}

    def overlay_of(scope: str | None) -> tuple[Proposal, dict[str, dict[str, JsonValue]]]:
        p = harness.setdefault(scope, Proposal("harness", scope, {"overlay": {"tools": {}}}))
        return p, p.spec["overlay"]["tools"]  # type: ignore[index,return-value]

    for f in findings:
        ev = f.evidence
        if f.kind == "schema_violation" and f.layer == "harness":
            tool, path, problem = str(ev["tool"]), str(ev["argument"]), str(ev["problem"])
            arg = _argument(path)
            declared = _declared(g, tool) or {}
            props = declared.get("properties")
            arg_schema = props.get(arg) if arg and isinstance(props, dict) and isinstance(props.get(arg), dict) else None
            sentence = constraint_text(problem, {} if problem == "required" else arg_schema)
            p, tools = overlay_of(_scope(f))
            patch = tools.setdefault(tool, {})
            if arg is not None and arg_schema is not None:  # the argument's own description says it too
                props_patch = patch.setdefault("properties", {})
                assert isinstance(props_patch, dict)
                earlier = props_patch.get(arg)
                prev = earlier.get("description") if isinstance(earlier, dict) else arg_schema.get("description")
                props_patch[arg] = {"description": f"{prev or ''} {sentence}".strip()}
            note = f"`{arg or path}`: {sentence}"
            old = str(patch.get("description_append") or "")
            patch["description_append"] = f"{old} {note}".strip() if note not in old else old
            p.findings.append(f.title)
            p.why.append(f.why)
        elif f.kind == "tool_failure_cluster" and f.layer == "harness":
            tool, signature = str(ev["tool"]), str(ev["signature"])
            p, tools = overlay_of(_scope(f))
            patch = tools.setdefault(tool, {})
            note = f"Calls of this tool often fail with \"{signature}\": check the arguments for that first."
            old = str(patch.get("description_append") or "")
            patch["description_append"] = f"{old} {note}".strip() if note not in old else old
            p.findings.append(f.title)
            p.why.append(f.why)
        elif f.kind == "corrections" and f.layer == "memory":
            tenant = f.tenants[0]
            p = memory.setdefault(tenant, Proposal("memory", tenant, {}))
            by_text: dict[str, dict[str, list[str]]] = defaultdict(lambda: {"sessions": [], "feedback": []})
            for c in g.corrections:
                if c.tenant == tenant and supplies_facts(c.text) and c.text.strip():
                    src = by_text[c.text.strip()]
                    if c.internal_id and c.internal_id not in src["sessions"]:
                        src["sessions"].append(c.internal_id)
                    if c.feedback_id:
                        src["feedback"].append(c.feedback_id)
            p.facts = [(text, dict(src)) for text, src in list(by_text.items())[:MAX_FACTS]]  # type: ignore[misc]
            p.findings.append(f.title)
            p.why.append(f.why)
    out = [p for p in harness.values() if p.spec["overlay"]["tools"]]  # type: ignore[index]
    return out + [p for p in memory.values() if p.facts]
