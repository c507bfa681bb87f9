-- replay_vs_original.sql: a replay next to the session it replays, step by step: outputs,
-- tool-call choices, token counts, and whether each matches.
-- Parameters: :tenant (text), :session_id (text, the replay's public id or the original's: an
-- original with several replays gives one block per replay).
SELECT
    replay_session_id,
    seq,
    original_step_id,
    replay_step_id,
    original_version,
    replay_version,
    replay_status,
    original_text,
    replay_text,
    same_text,
    original_tool_calls,
    replay_tool_calls,
    same_tool_calls,
    original_completion_tokens,
    replay_completion_tokens,
    original_prompt_tokens,
    replay_prompt_tokens
FROM atdp_replay_pairs
WHERE tenant = :tenant AND (replay_session_id = :session_id OR original_session_id = :session_id)
ORDER BY replay_session_id, seq;
