"""transcript lookup: a hash index on steps.transcript_hash, for a lone proxy's continuation reads

Revision ID: 0014
Revises: 0013
A proxy's continuation index is a cache over the stored steps (proxy.store.links, shared off): a
call whose parent the memory has let go of is linked by one read of `steps.transcript_hash`. 0011
dropped the btree on (tenant, hash) as too dear for the write path (about 130 bytes a step); a hash
index keeps a 4-byte hash code and the row pointer per step (NULLs, failed steps, are not indexed)
and answers the lookup's equality.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_steps_transcript_hash", "steps", ["transcript_hash"], unique=False,
                    postgresql_using="hash")


def downgrade() -> None:
    op.drop_index("ix_steps_transcript_hash", table_name="steps")
