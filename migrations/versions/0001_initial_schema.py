"""initial schema

Revision ID: 0001
Revises:
The whole ATDP store: tenants and keys, content-addressed contents, sessions, steps (with
token arrays and governance), tool calls, feedback, model versions and lineage, training runs,
stored Responses conversations, and an append-only audit log.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


AUDIT_APPEND_ONLY = """
CREATE FUNCTION atdp_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_log is append-only (% refused)', TG_OP;
END $$;
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION atdp_audit_append_only();
"""


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.Text(), nullable=True),
        sa.Column(
            "details",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_tenant_at", "audit_log", ["tenant_id", "at"], unique=False)
    op.create_table(
        "contents",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column(
            "redaction",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "hash"),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("parent_id", sa.String(length=36), nullable=True),
        sa.Column("checkpoint", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("training_run_id", sa.String(length=36), nullable=True),
        sa.Column(
            "metrics",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("served_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["model_versions.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("external_id", sa.String(length=256), nullable=False),
        sa.Column("client", sa.String(length=64), nullable=True),
        sa.Column(
            "client_info",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("task_id", sa.String(length=256), nullable=True),
        sa.Column("status", sa.String(length=16), server_default="open", nullable=False),
        sa.Column(
            "labels",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("last_step_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("replay_of", sa.String(length=36), nullable=True),
        sa.ForeignKeyConstraint(["replay_of"], ["sessions.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "external_id", name="uq_sessions_tenant_external"),
    )
    op.create_index("ix_sessions_task", "sessions", ["tenant_id", "task_id"], unique=False)
    op.create_index("ix_sessions_tenant_started", "sessions", ["tenant_id", "started_at"], unique=False)
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=True),
        sa.Column("step_id", sa.String(length=36), nullable=True),
        sa.Column("sealed", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_stored_responses_tenant", "stored_responses", ["tenant_id", "created_at"], unique=False
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column(
            "policy",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("policy_updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "training_runs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String(length=16), server_default="running", nullable=False),
        sa.Column(
            "config",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("host", sa.String(length=256), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("is_admin", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"], unique=False)
    op.create_table(
        "steps",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("parent_step_id", sa.String(length=36), nullable=True),
        sa.Column("api", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("upstream", sa.String(length=512), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("model_version", sa.String(length=64), nullable=True),
        sa.Column("system_hash", sa.String(length=64), nullable=True),
        sa.Column("tools_hash", sa.String(length=64), nullable=True),
        sa.Column("history_len", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "message_hashes", postgresql.ARRAY(sa.String(length=64)), server_default="{}", nullable=False
        ),
        sa.Column(
            "params",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("transcript_hash", sa.String(length=64), nullable=True),
        sa.Column("output_hash", sa.String(length=64), nullable=True),
        sa.Column("token_source", sa.String(length=16), nullable=False),
        sa.Column("prompt_prefix_len", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_token_ids", postgresql.ARRAY(sa.Integer()), server_default="{}", nullable=False),
        sa.Column("output_token_ids", postgresql.ARRAY(sa.Integer()), server_default="{}", nullable=False),
        sa.Column("output_logprobs", postgresql.ARRAY(sa.REAL()), server_default="{}", nullable=False),
        sa.Column(
            "output_versions",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'[]'::jsonb"),
            nullable=False,
        ),
        sa.Column("output_mask", postgresql.ARRAY(sa.Integer()), nullable=True),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("total_ms", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cost", sa.Float(), nullable=True),
        sa.Column(
            "redaction",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("eligibility", sa.String(length=16), nullable=False),
        sa.Column("eligibility_reason", sa.Text(), server_default="", nullable=False),
        sa.Column("visibility", sa.String(length=16), server_default="tenant", nullable=False),
        sa.Column("retention_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("trained_version_id", sa.String(length=36), nullable=True),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("skipped_reason", sa.Text(), nullable=True),
        sa.Column("replay_of", sa.String(length=36), nullable=True),
        sa.Column("written_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("session_id", "seq", name="uq_steps_session_seq"),
    )
    op.create_index("ix_steps_model_version", "steps", ["model_version"], unique=False)
    op.create_index(
        "ix_steps_retention",
        "steps",
        ["retention_until"],
        unique=False,
        postgresql_where=sa.text("retention_until IS NOT NULL"),
    )
    op.create_index("ix_steps_tenant_started", "steps", ["tenant_id", "started_at"], unique=False)
    op.create_index(
        "ix_steps_trainable",
        "steps",
        ["started_at"],
        unique=False,
        postgresql_where=sa.text("eligibility = 'eligible' AND trained_version_id IS NULL"),
    )
    op.create_index("ix_steps_transcript", "steps", ["tenant_id", "transcript_hash"], unique=False)
    op.create_table(
        "training_updates",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("version_id", sa.String(length=36), nullable=True),
        sa.Column("update", sa.Integer(), nullable=False),
        sa.Column("metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["training_runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_training_updates_run_id"), "training_updates", ["run_id"], unique=False)
    op.create_table(
        "version_lineage",
        sa.Column("version_id", sa.String(length=36), nullable=False),
        sa.Column("step_id", sa.String(length=36), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("advantage", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["version_id"], ["model_versions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("version_id", "step_id"),
    )
    op.create_index(op.f("ix_version_lineage_step_id"), "version_lineage", ["step_id"], unique=False)
    op.create_table(
        "feedback",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("step_id", sa.String(length=36), nullable=True),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("correction", sa.Text(), nullable=True),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("posted_by", sa.String(length=36), nullable=True),
        sa.Column("idempotency_key", sa.String(length=256), nullable=True),
        sa.Column("body_hash", sa.String(length=64), nullable=True),
        sa.Column("late", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column(
            "redaction",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["step_id"], ["steps.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "session_id", "idempotency_key", name="uq_feedback_idempotency"),
    )
    op.create_index(op.f("ix_feedback_session_id"), "feedback", ["session_id"], unique=False)
    op.create_index(op.f("ix_feedback_step_id"), "feedback", ["step_id"], unique=False)
    op.create_table(
        "tool_calls",
        sa.Column("step_id", sa.String(length=36), nullable=False),
        sa.Column("call_id", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("arguments", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("result_step_id", sa.String(length=36), nullable=True),
        sa.Column("result_hash", sa.String(length=64), nullable=True),
        sa.Column("is_error", sa.Boolean(), nullable=True),
        sa.ForeignKeyConstraint(["step_id"], ["steps.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("step_id", "call_id"),
    )
    op.create_index("ix_tool_calls_name", "tool_calls", ["tenant_id", "name"], unique=False)
    op.create_index(op.f("ix_tool_calls_session_id"), "tool_calls", ["session_id"], unique=False)

    op.execute(AUDIT_APPEND_ONLY)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS audit_log_append_only ON audit_log")
    op.execute("DROP FUNCTION IF EXISTS atdp_audit_append_only()")
    op.drop_index(op.f("ix_tool_calls_session_id"), table_name="tool_calls")
    op.drop_index("ix_tool_calls_name", table_name="tool_calls")
    op.drop_table("tool_calls")
    op.drop_index(op.f("ix_feedback_step_id"), table_name="feedback")
    op.drop_index(op.f("ix_feedback_session_id"), table_name="feedback")
    op.drop_table("feedback")
    op.drop_index(op.f("ix_version_lineage_step_id"), table_name="version_lineage")
    op.drop_table("version_lineage")
    op.drop_index(op.f("ix_training_updates_run_id"), table_name="training_updates")
    op.drop_table("training_updates")
    op.drop_index("ix_steps_transcript", table_name="steps")
    op.drop_index(
        "ix_steps_trainable",
        table_name="steps",
        postgresql_where=sa.text("eligibility = 'eligible' AND trained_version_id IS NULL"),
    )
    op.drop_index("ix_steps_tenant_started", table_name="steps")
    op.drop_index(
        "ix_steps_retention", table_name="steps", postgresql_where=sa.text("retention_until IS NOT NULL")
    )
    op.drop_index("ix_steps_model_version", table_name="steps")
    op.drop_table("steps")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("training_runs")
    op.drop_table("tenants")
    op.drop_index("ix_stored_responses_tenant", table_name="stored_responses")
    op.drop_table("stored_responses")
    op.drop_index("ix_sessions_tenant_started", table_name="sessions")
    op.drop_index("ix_sessions_task", table_name="sessions")
    op.drop_table("sessions")
    op.drop_table("model_versions")
    op.drop_table("contents")
    op.drop_index("ix_audit_tenant_at", table_name="audit_log")
    op.drop_table("audit_log")
