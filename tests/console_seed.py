"""Bulk-seeded stores for the console: many sessions in a few SQL statements (generate_series), with
versions, gates, tool calls and results, redactions and feedback, so every console page has something
real to show. Used by the console's browser test, `bench/console_load.py` and
`bench/console_screenshots.py`. Model versions are global to a deployment: seed a fresh database.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import orjson
from sqlalchemy import text
from sqlalchemy.engine import Engine

CLIENTS = ("claude-code", "codex", "hermes")
# name, status, parent, days before `now` it was served (None: never), replay-gate state and numbers
VERSIONS = (
    ("base", "retired", None, 4.0, None),
    ("v1", "retired", "base", 3.0, ("passed", 0.41, 0.30)),
    ("v2", "serving", "v1", 2.0, ("passed", 0.55, 0.41)),
    ("v3", "rejected", "v2", None, ("failed", 0.49, 0.55)),
)
SERVED = ("base", "v1", "v2")  # the versions sessions ran under, oldest first
MEAN_REWARD = {"base": 0.15, "v1": 0.35, "v2": 0.55}


@dataclass(frozen=True)
class Seeded:
    tenants: tuple[str, ...]
    sessions: int
    prefix: str


def _vid(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"atdp-console-seed/{name}"))


def seed_versions(engine: Engine, now: datetime, tenants: tuple[str, ...]) -> None:
    with engine.begin() as c:
        for name, status, parent, served_days, gate in VERSIONS:
            served = now - timedelta(days=served_days) if served_days is not None else None
            c.execute(text(
                "INSERT INTO model_versions (id, name, parent_id, checkpoint, status, metrics, created_at, served_at,"
                " retired_at) VALUES (:id, :name, :parent, :ckpt, :status, '{}'::jsonb, :created, :served, :retired)"),
                {"id": _vid(name), "name": name, "parent": _vid(parent) if parent else None, "ckpt": f"/ckpt/{name}",
                 "status": status, "created": (served or now) - timedelta(hours=1), "served": served,
                 "retired": served + timedelta(days=1) if status == "retired" and served else None})
            if gate is None:
                continue
            state, cand, serv = gate
            block = {"n": 64, "candidate_mean": cand, "serving_mean": serv, "diff_mean": round(cand - serv, 4),
                     "ci_low": round(cand - serv - 0.05, 4), "ci_high": round(cand - serv + 0.05, 4)}
            numbers = {"cases": 64, "overall": block, "tenants": {t: block for t in tenants},
                       "max_regression": dict.fromkeys(tenants, 0.02),
                       "reasons": [] if state == "passed" else ["overall ci_high < 0: the candidate is worse"]}
            c.execute(text("INSERT INTO version_gates (version_id, gate, state, numbers, started_at, finished_at) "
                           "VALUES (:id, 'replay_eval', :state, CAST(:numbers AS jsonb), :at, :at)"),
                      {"id": _vid(name), "state": state, "numbers": orjson.dumps(numbers).decode(),
                       "at": (served or now) - timedelta(minutes=30)})
            if name in SERVED:  # its lineage: the rewarded, eligible steps its parent served, as a trainer records it
                c.execute(text(LINEAGE_SQL), {"id": _vid(name), "parent": parent})


LINEAGE_SQL = """
WITH trained AS (
    INSERT INTO version_lineage (version_id, step_id, session_id, reward, advantage)
    SELECT :id, st.id, st.session_id, f.reward, f.reward - avg(f.reward) OVER ()
      FROM steps st JOIN feedback f ON f.session_id = st.session_id AND f.step_id IS NULL
     WHERE st.model_version = :parent AND st.eligibility = 'eligible'
    RETURNING step_id
)
UPDATE steps SET trained_version_id = :id WHERE id IN (SELECT step_id FROM trained)
"""

SESSIONS_SQL = """
INSERT INTO sessions (id, tenant_id, external_id, client, task_id, status, started_at, last_step_at, labels, client_info)
SELECT md5(:prefix || g)::uuid::text, (CAST(:tenants AS text[]))[1 + g % :nt], :prefix || '-' || lpad(g::text, 6, '0'),
       (CAST(:clients AS text[]))[1 + g % 3], 'task-' || (g % 12), CASE WHEN g % 5 = 0 THEN 'open' ELSE 'closed' END,
       :now - (g * :spacing) * interval '1 second', :now - (g * :spacing - 40) * interval '1 second', '{}'::jsonb, '{}'::jsonb
  FROM generate_series(0, :n - 1) g
"""

# Per session: the user's request (with an e-mail address redacted in every 7th), the model's tool call,
# the tool's result (an error in every 4th), the answer.
CONTENTS_SQL = """
INSERT INTO contents (tenant_id, hash, kind, body, size, redaction)
SELECT (CAST(:tenants AS text[]))[1 + g % :nt], md5(:prefix || 'c' || k || '-' || g), kind, body, 100, red
  FROM generate_series(0, :n - 1) g,
  LATERAL (VALUES
    (0, 'message', jsonb_build_object('role', 'user', 'content', CASE WHEN g % 7 = 0
        THEN 'Fix the failing test in module ' || (g % 50) || ' and mail <EMAIL_ADDRESS> when done.'
        ELSE 'Fix the failing test in module ' || (g % 50) || '.' END),
        CASE WHEN g % 7 = 0 THEN '{"EMAIL_ADDRESS": 1}'::jsonb ELSE '{}'::jsonb END),
    (1, 'output', jsonb_build_object('text', 'Let me run the tests first.', 'tool_calls', jsonb_build_array(
        jsonb_build_object('id', 'call-' || g, 'name', 'run_tests', 'arguments', jsonb_build_object('path', 'tests/m' || (g % 50))))),
        '{}'::jsonb),
    (2, 'message', jsonb_build_object('role', 'tool', 'tool_call_id', 'call-' || g, 'content', CASE WHEN g % 4 = 0
        THEN 'Error: ModuleNotFoundError: No module named ''app.settings''' ELSE '12 passed in 0.4s' END), '{}'::jsonb),
    (3, 'output', jsonb_build_object('text', CASE WHEN g % 4 = 0 THEN 'The module is missing; I created it.'
        ELSE 'All tests pass now.' END, 'tool_calls', '[]'::jsonb), '{}'::jsonb)
  ) AS x(k, kind, body, red)
"""

STEPS_SQL = """
INSERT INTO steps (id, session_id, tenant_id, seq, parent_step_id, api, status, upstream, model, model_version,
                   history_len, message_hashes, params, output_hash, token_source, started_at, ttft_ms, total_ms,
                   prompt_tokens, completion_tokens, redaction, eligibility, eligibility_reason)
SELECT md5(:prefix || 's' || k || '-' || g)::uuid::text, md5(:prefix || g)::uuid::text,
       (CAST(:tenants AS text[]))[1 + g % :nt], k + 1, CASE WHEN k = 1 THEN md5(:prefix || 's0-' || g)::uuid::text END,
       'chat.completions', 'ok', 'http://vllm:8000', 'agent-model',
       (CAST(:served AS text[]))[1 + least(:nv - 1, ((:n - 1 - g) * :nv) / :n)],
       CASE WHEN k = 0 THEN 0 ELSE 2 END,
       ARRAY[md5(:prefix || 'c' || (2 * k) || '-' || g)],
       '{}'::jsonb, md5(:prefix || 'c' || (1 + 2 * k) || '-' || g), 'engine',
       :now - (g * :spacing - 20 * k) * interval '1 second', 80 + (g % 40), 400 + (g % 300) + 200 * k,
       300 + 40 * k, 24 + (g % 16),
       CASE WHEN k = 0 AND g % 7 = 0 THEN '{"EMAIL_ADDRESS": 1}'::jsonb ELSE '{}'::jsonb END,
       CASE WHEN g % 9 = 0 THEN 'debug_only' ELSE 'eligible' END,
       CASE WHEN g % 9 = 0 THEN 'tenant policy: consent is debug_only' ELSE '' END
  FROM generate_series(0, :n - 1) g, generate_series(0, 1) k
"""

TOOL_CALLS_SQL = """
INSERT INTO tool_calls (step_id, call_id, session_id, tenant_id, name, arguments, result_step_id, result_hash, is_error)
SELECT md5(:prefix || 's0-' || g)::uuid::text, 'call-' || g, md5(:prefix || g)::uuid::text,
       (CAST(:tenants AS text[]))[1 + g % :nt], 'run_tests', jsonb_build_object('path', 'tests/m' || (g % 50)),
       md5(:prefix || 's1-' || g)::uuid::text, md5(:prefix || 'c2-' || g), g % 4 = 0
  FROM generate_series(0, :n - 1) g
"""

# A session reward for 4 in 5 sessions: the version's mean plus a spread, within [-1, 1].
FEEDBACK_SQL = """
INSERT INTO feedback (id, session_id, tenant_id, reward, source, created_at)
SELECT md5(:prefix || 'f' || g)::uuid::text, md5(:prefix || g)::uuid::text, (CAST(:tenants AS text[]))[1 + g % :nt],
       greatest(-1, least(1, (CAST(:means AS float8[]))[1 + least(:nv - 1, ((:n - 1 - g) * :nv) / :n)]
                             + ((g * 7919) % 101 - 50) / 100.0)),
       'human', :now - (g * :spacing - 60) * interval '1 second'
  FROM generate_series(0, :n - 1) g WHERE g % 5 <> 0
"""


def seed(engine: Engine, *, sessions: int, tenants: tuple[str, ...] = ("acme", "globex"), prefix: str = "sess",
         now: datetime | None = None, span_days: float = 3.0, versions: bool = True) -> Seeded:
    """`sessions` sessions of two steps each, newest first from `now` back over `span_days`."""
    now = now or datetime.now(UTC)
    params = {"prefix": prefix, "tenants": list(tenants), "nt": len(tenants), "n": sessions, "now": now,
              "spacing": max(1, int(span_days * 86400 / max(sessions, 1))), "clients": list(CLIENTS),
              "served": list(SERVED), "nv": len(SERVED), "means": [MEAN_REWARD[v] for v in SERVED]}
    with engine.begin() as c:
        for tenant in tenants:
            c.execute(text("INSERT INTO tenants (id) VALUES (:t) ON CONFLICT DO NOTHING"), {"t": tenant})
        for sql in (SESSIONS_SQL, CONTENTS_SQL, STEPS_SQL, TOOL_CALLS_SQL, FEEDBACK_SQL):
            c.execute(text(sql), params)
        for table in ("sessions", "steps", "feedback", "contents", "tool_calls"):
            c.execute(text(f"ANALYZE {table}"))
    if versions:
        seed_versions(engine, now, tenants)
    return Seeded(tenants=tenants, sessions=sessions, prefix=prefix)
