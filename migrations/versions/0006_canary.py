"""canary assignments

Revision ID: 0006
Revises: 0004
Gate 3, the canary (docs/control-plane.md): `canaries` holds one row per canary (the candidate, the
version it is compared with, the share of new sessions, the replicas that serve it, the margins, and
its decision); `canary_sessions` holds every session that started during a canary and the arm it was
assigned to, so assignment is sticky across restarts and across proxies. The view
`atdp_version_cards` gains two columns at its end: `canary_sessions` (per tenant, the sessions the
version served during its canary) and `canary_decision` (promoted | rolled_back, null while running).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0003's view (what the downgrade restores) and the same with the canary's columns appended: a view's
# columns may only be added at its end.
CARDS_0003 = """
SELECT
    v.id AS version_id,
    v.name,
    v.status,
    v.checkpoint,
    p.name AS parent,
    v.created_at,
    v.served_at,
    v.retired_at,
    lin.steps AS trained_steps,
    lin.sessions AS trained_sessions,
    lin.tenants AS trained_tenants,
    lin.tasks AS trained_tasks,
    lin.reward_mean,
    lin.reward_std,
    lin.reward_min,
    lin.reward_max,
    (SELECT u.metrics FROM training_updates u WHERE u.version_id = v.id ORDER BY u.id DESC LIMIT 1)
        AS training_metrics,
    CASE
        WHEN ov.actor IS NOT NULL THEN 'operator override'
        WHEN v.training_run_id IS NOT NULL THEN 'trainer schedule'
        WHEN v.name = 'base' THEN 'base (the engine''s start-up weights)'
        ELSE 'operator'
    END AS why,
    ov.actor AS override_actor,
    ov.at AS override_at,
    (SELECT coalesce(jsonb_agg(jsonb_build_object('gate', g.gate, 'state', g.state, 'numbers', g.numbers,
                                                  'started_at', g.started_at, 'finished_at', g.finished_at)
                               ORDER BY g.started_at), '[]'::jsonb)
       FROM version_gates g WHERE g.version_id = v.id) AS gates,
    (SELECT coalesce(jsonb_object_agg(x.tenant_id, x.sessions), '{}'::jsonb)
       FROM (SELECT st.tenant_id, count(DISTINCT st.session_id) AS sessions
               FROM steps st WHERE st.model_version = v.name GROUP BY st.tenant_id) x) AS affected_sessions,
    (SELECT b.name FROM model_versions b
      WHERE b.id <> v.id AND b.served_at IS NOT NULL AND v.served_at IS NOT NULL AND b.served_at < v.served_at
      ORDER BY b.served_at DESC LIMIT 1) AS rollback_restores
FROM model_versions v
LEFT JOIN model_versions p ON p.id = v.parent_id
LEFT JOIN LATERAL (
    SELECT count(*) AS steps,
           count(DISTINCT l.session_id) AS sessions,
           array_remove(array_agg(DISTINCT se.tenant_id), NULL) AS tenants,
           array_remove(array_agg(DISTINCT se.task_id), NULL) AS tasks,
           avg(l.reward) AS reward_mean,
           stddev_pop(l.reward) AS reward_std,
           min(l.reward) AS reward_min,
           max(l.reward) AS reward_max
      FROM version_lineage l LEFT JOIN sessions se ON se.id = l.session_id
     WHERE l.version_id = v.id
) lin ON true
LEFT JOIN LATERAL (
    SELECT a.actor, a.at FROM audit_log a
     WHERE a.target = v.id AND a.action = 'version.promote_override' ORDER BY a.at LIMIT 1
) ov ON true
"""

CANARY_COLUMNS = """,
    (SELECT coalesce(jsonb_object_agg(x.tenant_id, x.sessions), '{}'::jsonb)
       FROM (SELECT cs.tenant_id, count(*) AS sessions
               FROM canary_sessions cs
              WHERE cs.version_id = v.id AND cs.arm = 'candidate'
                AND EXISTS (SELECT 1 FROM sessions se JOIN steps st ON st.session_id = se.id
                             WHERE se.tenant_id = cs.tenant_id AND se.external_id = cs.session_id
                               AND st.model_version = v.name)
              GROUP BY cs.tenant_id) x) AS canary_sessions,
    (SELECT c.decision FROM canaries c WHERE c.version_id = v.id) AS canary_decision
FROM model_versions v
"""
CARDS = CARDS_0003.replace(" AS rollback_restores\nFROM model_versions v\n", " AS rollback_restores" + CANARY_COLUMNS, 1)
assert CARDS != CARDS_0003


def upgrade() -> None:
    op.create_table(
        "canaries",
        sa.Column("version_id", sa.String(36), sa.ForeignKey("model_versions.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("serving_id", sa.String(36), sa.ForeignKey("model_versions.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("fraction", sa.Float(), nullable=False),
        sa.Column("tenants", postgresql.JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("replicas", postgresql.JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("margins", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True)),
        sa.Column("decision", sa.String(16)),
        sa.Column("numbers", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
    )
    op.create_table(
        "canary_sessions",
        sa.Column("version_id", sa.String(36), sa.ForeignKey("canaries.version_id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("tenant_id", sa.String(128), primary_key=True),
        sa.Column("session_id", sa.String(256), primary_key=True),  # the public (external) id
        sa.Column("arm", sa.String(16), nullable=False),  # candidate | serving
        sa.Column("assigned_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
    )
    op.execute(f"CREATE OR REPLACE VIEW atdp_version_cards AS {CARDS}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS atdp_version_cards")
    op.execute(f"CREATE VIEW atdp_version_cards AS {CARDS_0003}")
    op.drop_table("canary_sessions")
    op.drop_table("canaries")
