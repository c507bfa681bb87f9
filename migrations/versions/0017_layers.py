"""layers: harness and memory versions beside weight versions, in one lineage table

Revision ID: 0017
Revises: 0016

A version has a layer: `policy` (weights: a checkpoint), `harness` (an overlay the proxy applies to every
call of its scope: system-prompt additions, tool description and schema overrides, stop sequences) or
`memory` (a set of a tenant's facts, retrieved into the calls' context). `spec` holds the overlay or the
facts' ids; `tenant_id` the scope (NULL: every tenant; memory is always a tenant's). A harness or memory
version has no checkpoint. `memory_facts` holds the facts (redacted text, the feedback and sessions that
supplied them, a full-text vector searched per call). Each step says which harness and memory version
its call was sent with, and which facts were put into its context.

`atdp_version_cards` counts a layer version's affected sessions (and those of its canary arm) from those
columns, restores a version of the same layer and scope on rollback, and gains `layer`, `scope` and
`spec` at its end. A harness or memory canary is a `canaries` row like a weight version's, its serving
arm possibly no version at all (`serving_id` NULL).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CARDS_0006 = """
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
      ORDER BY b.served_at DESC LIMIT 1) AS rollback_restores,
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
        WHEN v.layer <> 'policy' THEN coalesce(v.metrics->>'trigger', 'operator')
        ELSE 'operator'
    END AS why,
    ov.actor AS override_actor,
    ov.at AS override_at,
    (SELECT coalesce(jsonb_agg(jsonb_build_object('gate', g.gate, 'state', g.state, 'numbers', g.numbers,
                                                  'started_at', g.started_at, 'finished_at', g.finished_at)
                               ORDER BY g.started_at), '[]'::jsonb)
       FROM version_gates g WHERE g.version_id = v.id) AS gates,
    CASE v.layer
        WHEN 'harness' THEN (SELECT coalesce(jsonb_object_agg(x.tenant_id, x.sessions), '{}'::jsonb)
            FROM (SELECT st.tenant_id, count(DISTINCT st.session_id) AS sessions
                    FROM steps st WHERE st.harness_version = v.id GROUP BY st.tenant_id) x)
        WHEN 'memory' THEN (SELECT coalesce(jsonb_object_agg(x.tenant_id, x.sessions), '{}'::jsonb)
            FROM (SELECT st.tenant_id, count(DISTINCT st.session_id) AS sessions
                    FROM steps st WHERE st.memory_version = v.id GROUP BY st.tenant_id) x)
        ELSE (SELECT coalesce(jsonb_object_agg(x.tenant_id, x.sessions), '{}'::jsonb)
            FROM (SELECT st.tenant_id, count(DISTINCT st.session_id) AS sessions
                    FROM steps st WHERE st.model_version = v.name GROUP BY st.tenant_id) x)
    END AS affected_sessions,
    (SELECT b.name FROM model_versions b
      WHERE b.id <> v.id AND b.served_at IS NOT NULL AND v.served_at IS NOT NULL AND b.served_at < v.served_at
        AND b.layer = v.layer AND b.tenant_id IS NOT DISTINCT FROM v.tenant_id
      ORDER BY b.served_at DESC LIMIT 1) AS rollback_restores,
    (SELECT coalesce(jsonb_object_agg(x.tenant_id, x.sessions), '{}'::jsonb)
       FROM (SELECT cs.tenant_id, count(*) AS sessions
               FROM canary_sessions cs
              WHERE cs.version_id = v.id AND cs.arm = 'candidate'
                AND EXISTS (SELECT 1 FROM sessions se JOIN steps st ON st.session_id = se.id
                             WHERE se.tenant_id = cs.tenant_id AND se.external_id = cs.session_id
                               AND CASE v.layer WHEN 'harness' THEN st.harness_version = v.id
                                                WHEN 'memory' THEN st.memory_version = v.id
                                                ELSE st.model_version = v.name END)
              GROUP BY cs.tenant_id) x) AS canary_sessions,
    (SELECT c.decision FROM canaries c WHERE c.version_id = v.id) AS canary_decision,
    v.layer,
    v.tenant_id AS scope,
    v.spec
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
    op.add_column("model_versions", sa.Column("layer", sa.String(16), server_default="policy", nullable=False))
    op.add_column("model_versions", sa.Column("tenant_id", sa.String(128)))
    op.add_column("model_versions", sa.Column("spec", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"),
                                              nullable=False))
    op.alter_column("model_versions", "checkpoint", nullable=True)
    # A harness or memory canary may run where no version of its layer serves yet (its serving arm: none).
    op.alter_column("canaries", "serving_id", nullable=True)
    op.create_index("ix_model_versions_layer_status", "model_versions", ["layer", "status"])
    op.create_table(
        "memory_facts",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("source", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("created_by", sa.String(128)),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("tsv", postgresql.TSVECTOR(), sa.Computed("to_tsvector('english', text)", persisted=True)),
    )
    op.create_index("ix_memory_facts_tenant", "memory_facts", ["tenant_id"])
    op.create_index("ix_memory_facts_tsv", "memory_facts", ["tsv"], postgresql_using="gin")
    op.create_index("ix_memory_facts_sessions", "memory_facts", [sa.text("(source -> 'sessions')")],
                    postgresql_using="gin")
    op.add_column("steps", sa.Column("harness_version", sa.String(36)))
    op.add_column("steps", sa.Column("memory_version", sa.String(36)))
    op.add_column("steps", sa.Column("memory_facts", postgresql.ARRAY(sa.String(36))))
    op.create_index("ix_steps_harness_version", "steps", ["harness_version"],
                    postgresql_where=sa.text("harness_version IS NOT NULL"))
    op.create_index("ix_steps_memory_version", "steps", ["memory_version"],
                    postgresql_where=sa.text("memory_version IS NOT NULL"))
    op.execute(f"CREATE OR REPLACE VIEW atdp_version_cards AS {CARDS}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS atdp_version_cards")
    op.drop_index("ix_steps_memory_version", table_name="steps")
    op.drop_index("ix_steps_harness_version", table_name="steps")
    op.drop_column("steps", "memory_facts")
    op.drop_column("steps", "memory_version")
    op.drop_column("steps", "harness_version")
    op.drop_table("memory_facts")
    op.drop_index("ix_model_versions_layer_status", table_name="model_versions")
    op.execute("DELETE FROM model_versions WHERE layer <> 'policy'")  # their canaries go with them (cascade)
    op.alter_column("canaries", "serving_id", nullable=False)
    op.alter_column("model_versions", "checkpoint", nullable=False)
    op.drop_column("model_versions", "spec")
    op.drop_column("model_versions", "tenant_id")
    op.drop_column("model_versions", "layer")
    op.execute(f"CREATE VIEW atdp_version_cards AS {CARDS_0006}")
