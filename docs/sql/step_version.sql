-- step_version.sql: which model version produced a step. `model_version` is the version that served
-- the first output token; the runs list every version that produced output tokens (a weight swap
-- mid-stream gives two runs), joined to the registered version when there is one.
-- Parameters: :step_id (text).
SELECT
    r.step_id,
    r.session_id,
    r.tenant,
    r.model,
    r.model_version,
    run.i AS run,
    run.v ->> 0 AS token_version,
    (run.v ->> 1)::int AS tokens,
    mv.id AS version_id,
    mv.name AS version_name,
    mv.status AS version_status,
    mv.checkpoint,
    mv.parent_id AS parent_version_id
FROM atdp_steps_readable r
JOIN steps st ON st.id = r.step_id
LEFT JOIN LATERAL jsonb_array_elements(st.output_versions) WITH ORDINALITY AS run(v, i) ON true
LEFT JOIN model_versions mv ON mv.id = coalesce(run.v ->> 0, r.model_version)
                            OR mv.name = coalesce(run.v ->> 0, r.model_version)
WHERE r.step_id = :step_id
ORDER BY run.i;
