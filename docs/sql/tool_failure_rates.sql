-- tool_failure_rates.sql: per tool, how often the model called it, how many results came back,
-- how many of those were errors, and the failure rate (errors / results). Worst first.
-- Parameters: :tenant (text, NULL = every tenant).
SELECT tenant, tool, calls, results, errors, unanswered, failure_rate
FROM atdp_tool_failures
WHERE CAST(:tenant AS text) IS NULL OR tenant = :tenant
ORDER BY failure_rate DESC NULLS LAST, calls DESC, tenant, tool;
