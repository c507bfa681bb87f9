-- redaction_counts.sql: values redacted per entity type (EMAIL_ADDRESS, API_KEY, ...), over stored
-- contents (each distinct content counted once) and feedback texts.
-- Parameters: :tenant (text, NULL = every tenant).
SELECT
    tenant,
    entity,
    sum(redacted_values) AS redacted_values,
    sum(items) AS items,
    array_agg(DISTINCT source ORDER BY source) AS found_in
FROM atdp_redaction_counts
WHERE CAST(:tenant AS text) IS NULL OR tenant = :tenant
GROUP BY tenant, entity
ORDER BY tenant, redacted_values DESC, entity;
