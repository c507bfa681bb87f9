"""What a diagnosis reads from the store: plain SQL over the tables and the stable audit views,
bounded by a time window, a tenant (None: all) and `Rules.max_rows` per signal.

The queries are module constants so a finding can quote the SQL that reproduces it
(`evidence_sql` fills the parameters in as literals, for pasting into psql).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.orm import Session

from proxy.evolve.signals import JsonValue, result_text, text_of

TOOL_USES = """
SELECT tc.tenant_id AS tenant, se.external_id AS session_id, se.task_id, tc.name AS tool,
       tc.arguments, tc.is_error, r.body AS result, st.tools_hash, st.started_at
FROM tool_calls tc
JOIN steps st ON st.id = tc.step_id AND st.session_id = tc.session_id
JOIN sessions se ON se.id = tc.session_id
LEFT JOIN LATERAL (SELECT atdp_content(c.tenant_id, c.kind, c.body) AS body FROM contents c
                   WHERE c.tenant_id = tc.tenant_id AND c.hash = tc.result_hash) r ON true
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
SELECT f.tenant, f.session_id, se.task_id, coalesce(f.correction, f.comment, '') AS correction, f.created_at,
       se.id AS internal_id, f.feedback_id
FROM atdp_feedback_readable f
JOIN sessions se ON se.id = f.session_internal_id
WHERE f.is_correction AND se.replay_of IS NULL AND se.started_at >= :since
  AND (CAST(:tenant AS text) IS NULL OR f.tenant = :tenant)
ORDER BY f.created_at DESC LIMIT :limit"""

LAST_TRAINED = """
SELECT v.id, v.name, v.created_at FROM model_versions v
WHERE v.layer = 'policy' AND EXISTS (SELECT 1 FROM version_lineage l WHERE l.version_id = v.id)
ORDER BY v.created_at DESC LIMIT 1"""

_STEP_MIX = """
SELECT st.tenant_id AS tenant, coalesce(se.task_id, '') AS task_id,
       st.prompt_tokens + st.completion_tokens AS tokens,
       ARRAY(SELECT tc.name FROM tool_calls tc WHERE tc.step_id = st.id ORDER BY tc.name) AS tools
FROM steps st JOIN sessions se ON se.id = st.session_id
WHERE st.status = 'ok' AND st.replay_of IS NULL
  AND (CAST(:tenant AS text) IS NULL OR st.tenant_id = :tenant) AND {where}
ORDER BY st.started_at DESC LIMIT :limit"""
_TRAINING_WHERE = "st.id IN (SELECT step_id FROM version_lineage WHERE version_id = :version_id)"
_RECENT_WHERE = "st.started_at >= greatest(CAST(:since AS timestamptz), CAST(:after AS timestamptz))"
TRAINING_MIX = _STEP_MIX.format(where=_TRAINING_WHERE)
RECENT_MIX = _STEP_MIX.format(where=_RECENT_WHERE)

# --- the fast path: the same rows, grouped in PostgreSQL (docs/diagnosis.md, "How it is computed") ---
# The newest `limit` tool calls as TOOL_USES reads them, reduced to what the rules use: per tool the
# calls, answered calls and failures; the failures grouped by (tenant, session, task, tool, the part of
# the result body that `signals.result_text` reads); the calls with a declared tools list grouped by
# (tenant, session, task, tool, tools hash, arguments). Each group keeps its newest step's time, so
# example sessions come out in the order TOOL_USES gives them.
TOOL_GROUPS = """
WITH u AS MATERIALIZED (
    SELECT tc.tenant_id AS tenant, se.external_id AS session_id, se.task_id, tc.name AS tool, st.started_at,
           st.tools_hash, tc.arguments, tc.is_error,
           coalesce(jsonb_typeof(r.body) <> 'null', false) AS answered,
           coalesce(r.body -> 'content', r.body -> 'output', r.body) AS result
    FROM tool_calls tc
    JOIN steps st ON st.id = tc.step_id AND st.session_id = tc.session_id
    JOIN sessions se ON se.id = tc.session_id
    LEFT JOIN LATERAL (SELECT atdp_content(c.tenant_id, c.kind, c.body) AS body FROM contents c
                       WHERE c.tenant_id = tc.tenant_id AND c.hash = tc.result_hash) r ON true
    WHERE st.replay_of IS NULL AND se.started_at >= :since
      AND (CAST(:tenant AS text) IS NULL OR tc.tenant_id = :tenant)
    ORDER BY st.started_at DESC LIMIT :limit
), f AS (SELECT * FROM u WHERE answered AND coalesce(is_error, false))
SELECT 'count' AS kind, NULL AS tenant, NULL AS session_id, NULL AS task_id, tool, NULL::jsonb AS payload,
       NULL AS tools_hash, count(*) AS n, count(*) FILTER (WHERE answered) AS answered,
       count(*) FILTER (WHERE answered AND coalesce(is_error, false)) AS failed, NULL::timestamptz AS newest
  FROM u GROUP BY tool
UNION ALL
SELECT 'failure', tenant, session_id, task_id, tool, result, NULL, count(*), NULL, NULL, max(started_at)
  FROM f GROUP BY tenant, session_id, task_id, tool, result
UNION ALL
SELECT 'schema', tenant, session_id, task_id, tool, arguments, tools_hash, count(*), NULL, NULL, max(started_at)
  FROM u WHERE tools_hash IS NOT NULL GROUP BY tenant, session_id, task_id, tool, tools_hash, arguments
ORDER BY kind, newest DESC"""

# The window's sessions as SESSIONS reads them from atdp_session_outcomes, aggregating only their own
# steps and feedback (the view aggregates the whole store before it filters).
SESSION_ROWS = """
SELECT se.tenant_id AS tenant, se.external_id AS session_id, se.task_id, se.started_at,
       coalesce(st.prompt_tokens, 0) AS prompt_tokens, coalesce(st.completion_tokens, 0) AS completion_tokens,
       CASE coalesce(tn.policy ->> 'reward_combine', 'last')
           WHEN 'mean' THEN fb.mean_reward WHEN 'min' THEN fb.min_reward WHEN 'max' THEN fb.max_reward
           WHEN 'sum' THEN fb.sum_reward ELSE fb.last_reward END AS reward,
       coalesce(fb.corrections, 0) AS corrections, st.version
FROM sessions se
LEFT JOIN sessions orig ON orig.id = se.replay_of
LEFT JOIN tenants tn ON tn.id = se.tenant_id
LEFT JOIN LATERAL (
    SELECT sum(s.prompt_tokens) AS prompt_tokens, sum(s.completion_tokens) AS completion_tokens,
           (array_agg(s.model_version ORDER BY s.seq))[1] AS version
    FROM steps s WHERE s.session_id = se.id) st ON true
LEFT JOIN LATERAL (
    SELECT (array_agg(f.reward ORDER BY f.created_at DESC, f.id DESC)
               FILTER (WHERE f.reward IS NOT NULL AND f.step_id IS NULL))[1] AS last_reward,
           avg(f.reward) FILTER (WHERE f.step_id IS NULL) AS mean_reward,
           min(f.reward) FILTER (WHERE f.step_id IS NULL) AS min_reward,
           max(f.reward) FILTER (WHERE f.step_id IS NULL) AS max_reward,
           sum(f.reward) FILTER (WHERE f.step_id IS NULL) AS sum_reward,
           count(*) FILTER (WHERE f.correction IS NOT NULL OR f.source = 'user_correction') AS corrections
    FROM feedback f WHERE f.session_id = se.id) fb ON true
WHERE orig.external_id IS NULL AND se.started_at >= :since
  AND (CAST(:tenant AS text) IS NULL OR se.tenant_id = :tenant)
ORDER BY se.started_at DESC LIMIT :limit"""

# A step mix (TRAINING_MIX, RECENT_MIX: the same steps) counted by (tenant, task, tokens, tools) in
# PostgreSQL; each step's tools (sorted names) come from one aggregate of tool_calls, not a subquery a step.
_MIX_GROUPS = """
WITH m AS (
    SELECT st.id, st.tenant_id AS tenant, coalesce(se.task_id, '') AS task_id,
           st.prompt_tokens + st.completion_tokens AS tokens
    FROM steps st JOIN sessions se ON se.id = st.session_id
    WHERE st.status = 'ok' AND st.replay_of IS NULL
      AND (CAST(:tenant AS text) IS NULL OR st.tenant_id = :tenant) AND {where}
    ORDER BY st.started_at DESC LIMIT :limit
)
SELECT m.tenant, m.task_id, m.tokens, coalesce(t.tools, '{{}}') AS tools, count(*) AS n
FROM m LEFT JOIN (SELECT step_id, array_agg(name ORDER BY name) AS tools FROM tool_calls GROUP BY step_id) t
       ON t.step_id = m.id
GROUP BY 1, 2, 3, 4"""
TRAINING_GROUPS = _MIX_GROUPS.format(where=_TRAINING_WHERE)
RECENT_GROUPS = _MIX_GROUPS.format(where=_RECENT_WHERE)


@dataclass
class ToolUse:
    """Tool calls of one session to one tool with the same result text (a failure) or the same
    arguments and declared tools (a schema check): `n` of them, newest first in `Gathered`."""

    tenant: str
    session_id: str
    task_id: str | None
    tool: str
    arguments: JsonValue
    result: str  # the result's text (failures), "" otherwise
    schema: JsonValue  # the step's declared tools (the whole list), or None
    schema_key: tuple[str, str] | None = None  # (tenant, tools hash) of `schema`
    n: int = 1


@dataclass
class ToolCounts:
    """Per tool: calls, calls whose result came back, and those marked as errors."""

    calls: Counter[str] = field(default_factory=Counter)
    answered: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)


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
    internal_id: str | None = None  # the session's internal id (what a forget deletes by)
    feedback_id: str | None = None


@dataclass
class StepMix:
    tenant: str
    task_id: str
    tokens: int
    tools: list[str]
    n: int = 1  # steps alike


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
    tool_counts: ToolCounts
    failures: list[ToolUse]  # answered calls marked as errors
    checked: list[ToolUse]  # calls whose step declared its tools
    sessions: list[SessionRow]
    corrections: list[Correction]
    training: TrainingWindow | None


def _schemas(s: Session, pairs: set[tuple[str, str]]) -> dict[tuple[str, str], JsonValue]:
    if not pairs:
        return {}
    keys = sorted(pairs)
    binds = {f"t{i}": tenant for i, (tenant, _) in enumerate(keys)} | {f"h{i}": h for i, (_, h) in enumerate(keys)}
    sql = TOOL_SCHEMAS.format(pairs=", ".join(f"(:t{i}, :h{i})" for i in range(len(keys))))
    return {(r.tenant_id, r.hash): r.body for r in s.execute(text(sql), binds)}


def _tool_groups(s: Session, params: dict[str, object]) -> tuple[ToolCounts, list[ToolUse], list[ToolUse]]:
    """The fast path: TOOL_GROUPS, grouped in PostgreSQL."""
    counts, failures, checked = ToolCounts(), [], []
    rows = s.execute(text(TOOL_GROUPS), params).all()
    schemas = _schemas(s, {(r.tenant, r.tools_hash) for r in rows if r.kind == "schema"})
    for r in rows:
        if r.kind == "count":
            counts.calls[r.tool], counts.answered[r.tool], counts.failures[r.tool] = r.n, r.answered, r.failed
        elif r.kind == "failure":
            failures.append(ToolUse(tenant=r.tenant, session_id=r.session_id, task_id=r.task_id, tool=r.tool,
                                    arguments=None, result=text_of(r.payload), schema=None, n=r.n))
        else:
            key = (r.tenant, r.tools_hash)
            checked.append(ToolUse(tenant=r.tenant, session_id=r.session_id, task_id=r.task_id, tool=r.tool,
                                   arguments=r.payload, result="", schema=schemas.get(key), schema_key=key, n=r.n))
    return counts, failures, checked


def _tool_uses(s: Session, params: dict[str, object]) -> tuple[ToolCounts, list[ToolUse], list[ToolUse]]:
    """The reference path: every call of TOOL_USES read and counted here, one by one."""
    rows = s.execute(text(TOOL_USES), params).mappings().all()
    schemas = _schemas(s, {(r["tenant"], r["tools_hash"]) for r in rows if r["tools_hash"]})
    counts, failures, checked = ToolCounts(), [], []
    for r in rows:
        counts.calls[r["tool"]] += 1
        answered = r["result"] is not None
        failed = answered and bool(r["is_error"])
        counts.answered[r["tool"]] += answered
        counts.failures[r["tool"]] += failed
        use = dict(tenant=r["tenant"], session_id=r["session_id"], task_id=r["task_id"], tool=r["tool"])
        if failed:
            failures.append(ToolUse(**use, arguments=None, result=result_text(r["result"]), schema=None))
        if r["tools_hash"]:
            key = (r["tenant"], r["tools_hash"])
            checked.append(ToolUse(**use, arguments=r["arguments"], result="", schema=schemas.get(key), schema_key=key))
    return counts, failures, checked


def _mix(s: Session, sql: str, params: dict[str, object]) -> list[StepMix]:
    return [StepMix(tenant=r.tenant, task_id=r.task_id, tokens=int(r.tokens or 0), tools=list(r.tools or ()),
                    n=getattr(r, "n", 1)) for r in s.execute(text(sql), params)]


def gather(s: Session, *, since: datetime, tenant: str | None, limit: int, reference: bool = False) -> Gathered:
    """What the rules read. `reference`: read every row and count in Python (the slow, obvious path the
    fast one is tested against) instead of grouping in PostgreSQL."""
    params: dict[str, object] = {"since": since, "tenant": tenant, "limit": limit}
    sessions = [SessionRow(tenant=r.tenant, session_id=r.session_id, task_id=r.task_id, started_at=r.started_at,
                           prompt_tokens=int(r.prompt_tokens), completion_tokens=int(r.completion_tokens),
                           reward=r.reward, corrections=int(r.corrections), version=r.version)
                for r in s.execute(text(SESSIONS if reference else SESSION_ROWS), params)]
    corrections = [Correction(tenant=r.tenant, session_id=r.session_id, task_id=r.task_id, text=r.correction,
                              internal_id=r.internal_id, feedback_id=r.feedback_id)
                   for r in s.execute(text(CORRECTIONS), params)]
    training = None
    last = s.execute(text(LAST_TRAINED)).first()
    if last is not None:
        training = TrainingWindow(version_id=last.id, version=last.name, created_at=last.created_at,
                                  steps=_mix(s, TRAINING_MIX if reference else TRAINING_GROUPS,
                                             params | {"version_id": last.id}),
                                  recent=_mix(s, RECENT_MIX if reference else RECENT_GROUPS,
                                              params | {"after": last.created_at}))
    counts, failures, checked = (_tool_uses if reference else _tool_groups)(s, params)
    return Gathered(since=since, tenant=tenant, tool_counts=counts, failures=failures, checked=checked,
                    sessions=sessions, corrections=corrections, training=training)


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
JOIN steps st ON st.id = tc.step_id AND st.session_id = tc.session_id
JOIN sessions se ON se.id = tc.session_id
LEFT JOIN LATERAL (SELECT atdp_content(c.tenant_id, c.kind, c.body) AS body FROM contents c
                   WHERE c.tenant_id = tc.tenant_id AND c.hash = tc.result_hash) r ON true
WHERE st.replay_of IS NULL AND se.started_at >= :since AND tc.name = :tool AND {where}
  AND (CAST(:tenant AS text) IS NULL OR tc.tenant_id = :tenant)
ORDER BY st.started_at"""
TOOL_FAILURES_OF = TOOL_RESULTS_OF.format(where="tc.is_error")
TOOL_CALLS_OF = TOOL_RESULTS_OF.format(where="true")
ALL_TOOL_FAILURES = """
SELECT tc.tenant_id AS tenant, se.task_id, tc.name AS tool, count(*) AS failures,
       count(DISTINCT se.id) AS sessions
FROM tool_calls tc
JOIN steps st ON st.id = tc.step_id AND st.session_id = tc.session_id
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
