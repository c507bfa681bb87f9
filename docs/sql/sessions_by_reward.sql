-- sessions_by_reward.sql: rewarded sessions, best first within each tenant, with their size,
-- errors and corrections. The reward is combined by the tenant's stored policy (see README.md).
-- Parameters: :tenant (text, NULL = every tenant), :min_reward (float, NULL = no lower bound).
SELECT
    tenant,
    session_id,
    task_id,
    status,
    steps,
    error_steps,
    session_rewards,
    combined_reward,
    last_reward,
    corrections,
    started_at,
    ended_at
FROM atdp_session_outcomes
WHERE combined_reward IS NOT NULL
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
  AND (CAST(:min_reward AS float8) IS NULL OR combined_reward >= :min_reward)
ORDER BY tenant, combined_reward DESC, started_at, session_id;
