-- sessions_trained_version.sql: which sessions (and how many of their steps) trained a version.
-- Parameters: :version (text, the version id or its name).
SELECT
    version_id,
    version_name,
    tenant,
    session_id,
    count(*) AS steps,
    min(seq) AS first_seq,
    max(seq) AS last_seq,
    avg(reward) AS mean_reward
FROM atdp_version_lineage
WHERE version_id = :version OR version_name = :version
GROUP BY version_id, version_name, tenant, session_id
ORDER BY tenant, session_id;
