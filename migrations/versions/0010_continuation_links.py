"""continuation links shared by every proxy on one database

Revision ID: 0010
Revises: 0007
Continuation linking (a client that sends no session id joins the session whose transcript its
messages start with) was each proxy's memory. `continuation_links` holds the keys in PostgreSQL so
several `atdp serve` processes behind one load balancer link one conversation into one session: the
proxy that served a step writes its keys before the client has the whole answer; a proxy whose
memory misses reads them here.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "continuation_links",
        sa.Column("hash", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(1), primary_key=True),
        sa.Column("step_id", sa.String(36), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("parent_step_id", sa.String(36), nullable=True),
        sa.Column("history_len", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
    )
    op.create_index("ix_continuation_links_created", "continuation_links", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_continuation_links_created", table_name="continuation_links")
    op.drop_table("continuation_links")
