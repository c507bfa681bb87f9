"""audit views

Revision ID: 0002
Revises: 0001
Stable, documented SQL views for operators (audit, debugging, replay comparison); see
docs/sql/README.md. Their column names are part of the public interface: add columns at the end,
never rename. A later migration that alters a column these views read must drop and re-create them.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


VIEWS: list[tuple[str, str]] = [
    ("atdp_steps_readable", """
-- One row per step, in words: public session id, timings, tokens, governance, and what the model said.
SELECT
    st.id AS step_id,
    se.external_id AS session_id,
    st.tenant_id AS tenant,
    st.seq,
    st.parent_step_id,
    st.api,
    st.status,
    st.error ->> 'message' AS error_message,
    st.model,
    st.model_version,
    st.started_at,
    st.started_at + make_interval(secs => coalesce(st.total_ms, 0) / 1000.0) AS ended_at,
    st.ttft_ms,
    st.total_ms,
    st.prompt_tokens,
    st.completion_tokens,
    st.finish_reason,
    st.token_source,
    st.eligibility,
    st.eligibility_reason,
    st.redaction,
    o.body ->> 'text' AS assistant_text,
    ARRAY(
        SELECT c.call ->> 'name'
        FROM jsonb_array_elements(
            CASE WHEN jsonb_typeof(o.body -> 'tool_calls') = 'array' THEN o.body -> 'tool_calls' ELSE '[]'::jsonb END
        ) WITH ORDINALITY AS c(call, i)
        ORDER BY c.i
    ) AS tool_call_names,
    st.trained_version_id,
    st.replay_of,
    se.id AS session_internal_id
FROM steps st
JOIN sessions se ON se.id = st.session_id
LEFT JOIN contents o ON o.tenant_id = st.tenant_id AND o.hash = st.output_hash
"""),
    ("atdp_feedback_readable", """
-- Every feedback row with the public session id and the seq of the step it scores (NULL = session).
SELECT
    f.id AS feedback_id,
    se.external_id AS session_id,
    f.tenant_id AS tenant,
    f.step_id,
    st.seq AS step_seq,
    CASE WHEN f.step_id IS NULL THEN 'session' ELSE 'step' END AS scope,
    f.reward,
    f.source,
    f.comment,
    f.correction,
    (f.correction IS NOT NULL OR f.source = 'user_correction') AS is_correction,
    f.late,
    f.posted_by,
    f.created_at,
    se.id AS session_internal_id
FROM feedback f
JOIN sessions se ON se.id = f.session_id
LEFT JOIN steps st ON st.id = f.step_id
"""),
    ("atdp_session_outcomes", """
-- One row per session: size, errors, rewards (combined by the tenant's stored policy), corrections.
-- combined_reward follows tenants.policy->>'reward_combine' (default 'last'); a reward_combine set
-- only in the operator's policy file is not visible to SQL (the API and exports apply it).
WITH st AS (
    SELECT session_id,
           count(*) AS steps,
           count(*) FILTER (WHERE status <> 'ok') AS error_steps,
           count(*) FILTER (WHERE eligibility = 'eligible') AS eligible_steps,
           sum(prompt_tokens) AS prompt_tokens,
           sum(completion_tokens) AS completion_tokens
    FROM steps GROUP BY session_id
), fb AS (
    SELECT session_id,
           count(*) FILTER (WHERE reward IS NOT NULL AND step_id IS NULL) AS session_rewards,
           count(*) FILTER (WHERE reward IS NOT NULL AND step_id IS NOT NULL) AS step_rewards,
           (array_agg(reward ORDER BY created_at DESC, id DESC)
               FILTER (WHERE reward IS NOT NULL AND step_id IS NULL))[1] AS last_reward,
           avg(reward) FILTER (WHERE step_id IS NULL) AS mean_reward,
           min(reward) FILTER (WHERE step_id IS NULL) AS min_reward,
           max(reward) FILTER (WHERE step_id IS NULL) AS max_reward,
           sum(reward) FILTER (WHERE step_id IS NULL) AS sum_reward,
           count(*) FILTER (WHERE correction IS NOT NULL OR source = 'user_correction') AS corrections,
           count(*) FILTER (WHERE comment IS NOT NULL) AS comments,
           count(*) FILTER (WHERE late) AS late_feedback
    FROM feedback GROUP BY session_id
)
SELECT
    se.external_id AS session_id,
    se.tenant_id AS tenant,
    se.task_id,
    se.client,
    se.status,
    se.started_at,
    se.last_step_at,
    se.ended_at,
    coalesce(st.steps, 0) AS steps,
    coalesce(st.error_steps, 0) AS error_steps,
    coalesce(st.eligible_steps, 0) AS eligible_steps,
    coalesce(st.prompt_tokens, 0) AS prompt_tokens,
    coalesce(st.completion_tokens, 0) AS completion_tokens,
    coalesce(fb.session_rewards, 0) AS session_rewards,
    coalesce(fb.step_rewards, 0) AS step_rewards,
    CASE coalesce(tn.policy ->> 'reward_combine', 'last')
        WHEN 'mean' THEN fb.mean_reward
        WHEN 'min' THEN fb.min_reward
        WHEN 'max' THEN fb.max_reward
        WHEN 'sum' THEN fb.sum_reward
        ELSE fb.last_reward
    END AS combined_reward,
    fb.last_reward,
    coalesce(fb.corrections, 0) AS corrections,
    coalesce(fb.comments, 0) AS comments,
    coalesce(fb.late_feedback, 0) AS late_feedback,
    orig.external_id AS replay_of,
    se.id AS session_internal_id
FROM sessions se
LEFT JOIN st ON st.session_id = se.id
LEFT JOIN fb ON fb.session_id = se.id
LEFT JOIN tenants tn ON tn.id = se.tenant_id
LEFT JOIN sessions orig ON orig.id = se.replay_of
"""),
    ("atdp_tool_failures", """
-- Per tenant and tool: calls the model made, results the agent sent back, results marked as errors.
-- Replays are left out: their tool calls were never executed.
SELECT
    tc.tenant_id AS tenant,
    tc.name AS tool,
    count(*) AS calls,
    count(tc.result_step_id) AS results,
    count(*) FILTER (WHERE tc.is_error) AS errors,
    count(*) FILTER (WHERE tc.result_step_id IS NULL) AS unanswered,
    (count(*) FILTER (WHERE tc.is_error))::float8 / nullif(count(tc.result_step_id), 0) AS failure_rate
FROM tool_calls tc
JOIN steps st ON st.id = tc.step_id
WHERE st.replay_of IS NULL
GROUP BY tc.tenant_id, tc.name
"""),
    ("atdp_version_lineage", """
-- Which steps (and sessions) trained which model version.
SELECT
    v.id AS version_id,
    v.name AS version_name,
    v.status AS version_status,
    v.parent_id AS parent_version_id,
    v.created_at AS version_created_at,
    l.step_id,
    se.external_id AS session_id,
    se.tenant_id AS tenant,
    st.seq,
    st.model_version AS step_model_version,
    l.reward,
    l.advantage,
    l.session_id AS session_internal_id
FROM model_versions v
JOIN version_lineage l ON l.version_id = v.id
LEFT JOIN steps st ON st.id = l.step_id
LEFT JOIN sessions se ON se.id = l.session_id
"""),
    ("atdp_redaction_counts", """
-- Values redacted, per tenant, where (content kind, or feedback) and entity type. Each distinct
-- content is stored, and counted, once.
SELECT c.tenant_id AS tenant, c.kind AS source, e.key AS entity,
       sum(e.value::bigint) AS redacted_values, count(*) AS items
FROM contents c CROSS JOIN LATERAL jsonb_each_text(c.redaction) AS e
GROUP BY c.tenant_id, c.kind, e.key
UNION ALL
SELECT f.tenant_id, 'feedback', e.key, sum(e.value::bigint), count(*)
FROM feedback f CROSS JOIN LATERAL jsonb_each_text(f.redaction) AS e
GROUP BY f.tenant_id, e.key
"""),
    ("atdp_replay_pairs", """
-- A replayed step next to the step it replays: outputs, tool-call choices and token counts.
SELECT
    r.tenant,
    o.session_id AS original_session_id,
    r.session_id AS replay_session_id,
    o.seq,
    o.step_id AS original_step_id,
    r.step_id AS replay_step_id,
    o.model_version AS original_version,
    r.model_version AS replay_version,
    o.status AS original_status,
    r.status AS replay_status,
    o.assistant_text AS original_text,
    r.assistant_text AS replay_text,
    o.tool_call_names AS original_tool_calls,
    r.tool_call_names AS replay_tool_calls,
    o.completion_tokens AS original_completion_tokens,
    r.completion_tokens AS replay_completion_tokens,
    o.prompt_tokens AS original_prompt_tokens,
    r.prompt_tokens AS replay_prompt_tokens,
    o.finish_reason AS original_finish_reason,
    r.finish_reason AS replay_finish_reason,
    (o.assistant_text IS NOT DISTINCT FROM r.assistant_text) AS same_text,
    (o.tool_call_names = r.tool_call_names) AS same_tool_calls
FROM atdp_steps_readable r
JOIN atdp_steps_readable o ON o.step_id = r.replay_of
"""),
]


def upgrade() -> None:
    for name, body in VIEWS:
        op.execute(f"CREATE VIEW {name} AS {body}")


def downgrade() -> None:
    for name, _ in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
