-- correction_rate_by_day.sql: per day (UTC, by session start) and tenant, how many sessions ran,
-- how many received at least one user correction, and that share (the correction rate).
-- Replays are not user sessions and are left out.
-- Parameters: :tenant (text, NULL = every tenant), :since (timestamptz, NULL = from the start).
SELECT
    (started_at AT TIME ZONE 'UTC')::date AS day,
    tenant,
    count(*) AS sessions,
    count(*) FILTER (WHERE corrections > 0) AS corrected_sessions,
    sum(corrections) AS corrections,
    (count(*) FILTER (WHERE corrections > 0))::float8 / count(*) AS correction_rate
FROM atdp_session_outcomes
WHERE replay_of IS NULL
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
  AND (CAST(:since AS timestamptz) IS NULL OR started_at >= :since)
GROUP BY 1, 2
ORDER BY 1, 2;
