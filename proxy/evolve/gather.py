"""What a diagnosis reads from the store: plain SQL over the tables and the stable audit views,
bounded by a time window, a tenant (None: all) and `Rules.max_rows` per signal.

The queries are module constants so a finding can quote the SQL that reproduces it
(`evidence_sql` fills the parameters in as literals, for pasting into psql).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.orm import Session

from proxy.evolve.signals import JsonValue

TOOL_USES = """
SELECT tc.tenant_id AS tenant, se.external_id AS session_id, se.task_id, tc.name AS tool,
       tc.arguments, tc.is_error, r.body AS result, st.tools_hash, st.started_at
FROM tool_calls tc
JOIN steps st ON st.id = tc.step_id
JOIN sessions se ON se.id = tc.session_id
LEFT JOIN contents r ON r.tenant_id = tc.tenant_id AND r.hash = tc.result_hash
WHERE st.replay_of IS NULL AND se.started_at >= :since
  AND (CAST(:tenant AS text) IS NULL OR tc.tenant_id = :tenant)
ORDER BY st.started_at DESC LIMIT :limit"""

TOOL_SCHEMAS = "SELECT tenant_id, hash, body FROM contents WHERE kind = 'tools' AND (tenant_id, hash) IN ({pairs})"

SESSIONS = """
SELECT o.tenant, o.session_id, o.task_id, o.started_at, o.prompt_tokens, o.completion_tokens,
       o.combined_reward AS reward, o.corrections,
       (SELECT st.model_version FROM steps st WHERE st.session_id = o.session_internal_id
         ORDER BY st.seq LIMIT 1) AS version
FROM atdp_session_outcomes o
WHERE o.replay_of IS NULL AND o.started_at >= :since
  AND (CAST(:tenant AS text) IS NULL OR o.tenant = :tenant)
ORDER BY o.started_at DESC LIMIT :limit"""

CORRECTIONS = """
SELECT f.tenant, f.session_id, se.task_id, coalesce(f.correction, f.comment, '') AS correction, f.created_at
FROM atdp_feedback_readable f
JOIN sessions se ON se.id = f.session_internal_id
WHERE f.is_correction AND se.replay_of IS NULL AND se.started_at >= :since
  AND (CAST(:tenant AS text) IS NULL OR f.tenant = :tenant)
ORDER BY f.created_at DESC LIMIT :limit"""

LAST_TRAINED = """
SELECT v.id, v.name, v.created_at FROM model_versions v
WHERE EXISTS (SELECT 1 FROM version_lineage l WHERE l.version_id = v.id)
ORDER BY v.created_at DESC LIMIT 1"""

_STEP_MIX = """
SELECT st.tenant_id AS tenant, coalesce(se.task_id, '') AS task_id,
       st.prompt_tokens + st.completion_tokens AS tokens,
       ARRAY(SELECT tc.name FROM tool_calls tc WHERE tc.step_id = st.id ORDER BY tc.name) AS tools
FROM steps st JOIN sessions se ON se.id = st.session_id
WHERE st.status = 'ok' AND st.replay_of IS NULL
  AND (CAST(:tenant AS text) IS NULL OR st.tenant_id = :tenant) AND {where}
ORDER BY st.started_at DESC LIMIT :limit"""
TRAINING_MIX = _STEP_MIX.format(where="st.id IN (SELECT step_id FROM version_lineage WHERE version_id = :version_id)")
RECENT_MIX = _STEP_MIX.format(where="st.started_at >= greatest(CAST(:since AS timestamptz), CAST(:after AS timestamptz))")


@dataclass
class ToolUse:
    tenant: str
    session_id: str
    task_id: str | None
    tool: str
    arguments: JsonValue
    is_error: bool | None  # None: no result came back
    result: JsonValue
    schema: JsonValue  # the step's declared tools (the whole list), or None


@dataclass
class SessionRow:
    tenant: str
    session_id: str
    task_id: str | None
    started_at: datetime
    prompt_tokens: int
    completion_tokens: int
    reward: float | None
    corrections: int
    version: str | None


@dataclass
class Correction:
    tenant: str
    session_id: str
    task_id: str | None
    text: str


@dataclass
class StepMix:
    tenant: str
    task_id: str
    tokens: int
    tools: list[str]


@dataclass
class TrainingWindow:
    version_id: str
    version: str
    created_at: datetime
    steps: list[StepMix] = field(default_factory=list)
    recent: list[StepMix] = field(default_factory=list)


@dataclass
class Gathered:
    since: datetime
    tenant: str | None
    tool_uses: list[ToolUse]
    sessions: list[SessionRow]
    corrections: list[Correction]
    training: TrainingWindow | None


def _tool_uses(s: Session, params: dict[str, object]) -> list[ToolUse]:
    rows = s.execute(text(TOOL_USES), params).mappings().all()
    pairs = {(r["tenant"], r["tools_hash"]) for r in rows if r["tools_hash"]}
    schemas: dict[tuple[str, str], JsonValue] = {}
    if pairs:
        keys = sorted(pairs)
        binds = {f"t{i}": tenant for i, (tenant, _) in enumerate(keys)} | {f"h{i}": h for i, (_, h) in enumerate(keys)}
        sql = TOOL_SCHEMAS.format(pairs=", ".join(f"(:t{i}, :h{i})" for i in range(len(keys))))
        schemas = {(r.tenant_id, r.hash): r.body for r in s.execute(text(sql), binds)}
    return [ToolUse(tenant=r["tenant"], session_id=r["session_id"], task_id=r["task_id"], tool=r["tool"],
                    arguments=r["arguments"], is_error=None if r["result"] is None else bool(r["is_error"]),
                    result=r["result"], schema=schemas.get((r["tenant"], r["tools_hash"])))
            for r in rows]


def _mix(s: Session, sql: str, params: dict[str, object]) -> list[StepMix]:
    return [StepMix(tenant=r.tenant, task_id=r.task_id, tokens=int(r.tokens or 0), tools=list(r.tools or ()))
            for r in s.execute(text(sql), params)]


def gather(s: Session, *, since: datetime, tenant: str | None, limit: int) -> Gathered:
    params: dict[str, object] = {"since": since, "tenant": tenant, "limit": limit}
    sessions = [SessionRow(tenant=r.tenant, session_id=r.session_id, task_id=r.task_id, started_at=r.started_at,
                           prompt_tokens=int(r.prompt_tokens), completion_tokens=int(r.completion_tokens),
                           reward=r.reward, corrections=int(r.corrections), version=r.version)
                for r in s.execute(text(SESSIONS), params)]
    corrections = [Correction(tenant=r.tenant, session_id=r.session_id, task_id=r.task_id, text=r.correction)
                   for r in s.execute(text(CORRECTIONS), params)]
    training = None
    last = s.execute(text(LAST_TRAINED)).first()
    if last is not None:
        training = TrainingWindow(version_id=last.id, version=last.name, created_at=last.created_at,
                                  steps=_mix(s, TRAINING_MIX, params | {"version_id": last.id}),
                                  recent=_mix(s, RECENT_MIX, params | {"after": last.created_at}))
    return Gathered(since=since, tenant=tenant, tool_uses=_tool_uses(s, params), sessions=sessions,
                    corrections=corrections, training=training)


def _literal(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, datetime):
        return f"'{value.isoformat()}'"
    return "'" + str(value).replace("'", "''") + "'"


def evidence_sql(sql: str, params: dict[str, object]) -> str:
    """`sql` with its :parameters written as SQL literals (longest names first), ready for psql."""
    out = sql.strip()
    for name in sorted(params, key=len, reverse=True):
        out = out.replace(f":{name}", _literal(params[name]))
    return out

# --- the SQL a finding quotes as its evidence (same filters as the rows it counted) ------------------
TOOL_RESULTS_OF = """
SELECT se.external_id AS session_id, tc.tenant_id AS tenant, se.task_id, tc.name AS tool, tc.arguments,
       tc.is_error, r.body AS result
FROM tool_calls tc
JOIN steps st ON st.id = tc.step_id
JOIN sessions se ON se.id = tc.session_id
LEFT JOIN contents r ON r.tenant_id = tc.tenant_id AND r.hash = tc.result_hash
WHERE st.replay_of IS NULL AND se.started_at >= :since AND tc.name = :tool AND {where}
  AND (CAST(:tenant AS text) IS NULL OR tc.tenant_id = :tenant)
ORDER BY st.started_at"""
TOOL_FAILURES_OF = TOOL_RESULTS_OF.format(where="tc.is_error")
TOOL_CALLS_OF = TOOL_RESULTS_OF.format(where="true")
ALL_TOOL_FAILURES = """
SELECT tc.tenant_id AS tenant, se.task_id, tc.name AS tool, count(*) AS failures,
       count(DISTINCT se.id) AS sessions
FROM tool_calls tc
JOIN steps st ON st.id = tc.step_id
JOIN sessions se ON se.id = tc.session_id
WHERE tc.is_error AND st.replay_of IS NULL AND se.started_at >= :since
  AND (CAST(:tenant AS text) IS NULL OR tc.tenant_id = :tenant)
GROUP BY 1, 2, 3 ORDER BY failures DESC"""
SESSIONS_OF = """
SELECT session_id, tenant, task_id, started_at, prompt_tokens, completion_tokens, combined_reward, corrections
FROM atdp_session_outcomes
WHERE replay_of IS NULL AND started_at >= :since AND tenant = :tenant
  AND (CAST(:task AS text) IS NULL OR task_id = :task)
ORDER BY started_at"""
