"""tombstones and scoped keys

Revision ID: 0004
Revises: 0003
`tombstones`: forgotten sessions (and tenants) the writer checks before inserting, so spooled or
re-sent steps of a forgotten session never come back. `api_keys.scopes`: a key limited to named
actions (`versions:write`, the trainer's key), instead of the admin key.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tombstones",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("external_id", sa.String(length=256), nullable=True),
        sa.Column("forgotten_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tombstones_tenant_external", "tombstones", ["tenant_id", "external_id"])
    op.add_column("api_keys", sa.Column("scopes", postgresql.ARRAY(sa.String(length=64)), nullable=True))


def downgrade() -> None:
    op.drop_column("api_keys", "scopes")
    op.drop_index("ix_tombstones_tenant_external", table_name="tombstones")
    op.drop_table("tombstones")
