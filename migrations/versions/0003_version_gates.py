"""version gates and cards

Revision ID: 0003
Revises: 0002
The version lifecycle (docs/control-plane.md): `version_gates` holds each gate's state and numbers
for a version; the view `atdp_version_cards` answers, per version, what changed (lineage, rewards,
training metrics), why (trainer schedule or operator override), its gates, whom it served and what a
rollback restores. Like the audit views, its column names are public: add at the end, never rename.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CARDS = """
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


def upgrade() -> None:
    op.create_table(
        "version_gates",
        sa.Column("version_id", sa.String(36), sa.ForeignKey("model_versions.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("gate", sa.String(32), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("numbers", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
    )
    op.execute(f"CREATE VIEW atdp_version_cards AS {CARDS}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS atdp_version_cards")
    op.drop_table("version_gates")
