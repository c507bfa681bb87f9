"""lean storage: drop an index on the steps table that nothing reads

Revision ID: 0011
Revises: 0010
`ix_steps_transcript` indexed every step's rolling transcript hash (tenant + 64 hex characters, about
130 bytes a step) for continuation linking, which reads `continuation_links` since 0010: nothing
queries steps by it any more, and every step paid for it on insert (bench/write_path.py,
bench/storage.py).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("ix_steps_transcript", table_name="steps")


def downgrade() -> None:
    op.create_index("ix_steps_transcript", "steps", ["tenant_id", "transcript_hash"], unique=False)
