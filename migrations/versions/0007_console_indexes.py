"""console: keyset pagination indexes for the session listing

Revision ID: 0007
Revises: 0006
The session listing (`GET /atdp/v1/sessions`, the console's sessions page) pages newest first by
`(started_at, id)`; for every tenant (the admin key) and for one tenant. These indexes let each page
read only its own rows in order, whatever the size of the store: `(started_at, id)` for the admin's
listing, `(tenant_id, started_at, id)` for a tenant's (it replaces `(tenant_id, started_at)`, its prefix).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_sessions_started_id", "sessions", ["started_at", "id"])
    op.create_index("ix_sessions_tenant_started_id", "sessions", ["tenant_id", "started_at", "id"])
    op.drop_index("ix_sessions_tenant_started", table_name="sessions")


def downgrade() -> None:
    op.create_index("ix_sessions_tenant_started", "sessions", ["tenant_id", "started_at"])
    op.drop_index("ix_sessions_tenant_started_id", table_name="sessions")
    op.drop_index("ix_sessions_started_id", table_name="sessions")
