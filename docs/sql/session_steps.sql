-- session_steps.sql: one session's steps in order, with each tool call the model made and the
-- result the agent sent back for it (one row per tool call; a step without tool calls has one row).
-- Parameters: :tenant (text), :session_id (text, the public session id).
SELECT
    r.seq,
    r.step_id,
    r.status,
    r.model,
    r.model_version,
    r.started_at,
    r.completion_tokens,
    r.assistant_text,
    tc.call_id,
    tc.name AS tool,
    tc.arguments AS tool_arguments,
    res.seq AS result_seq,
    coalesce(rc.body -> 'content', rc.body) AS tool_result,
    tc.is_error AS tool_error
FROM atdp_steps_readable r
LEFT JOIN tool_calls tc ON tc.step_id = r.step_id
LEFT JOIN steps res ON res.id = tc.result_step_id
LEFT JOIN LATERAL (SELECT atdp_content(c.tenant_id, c.kind, c.body) AS body FROM contents c
                   WHERE c.tenant_id = tc.tenant_id AND c.hash = tc.result_hash) rc ON true
WHERE r.tenant = :tenant AND r.session_id = :session_id
ORDER BY r.seq, tc.call_id;
