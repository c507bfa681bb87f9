"""forget counts: tenants.forgets, one more for each forget that deleted a tenant's contents

Revision ID: 0016
Revises: 0015

A writer refers to a content it believes stored instead of writing it again. A forget that deleted it
is announced to every proxy, but a batch prepared before the note arrived would refer to a row that is
gone. The writer compares the count its cache reflects with this one, and checks the batch's
references when the database's is ahead (proxy.store.forgets).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("forgets", sa.BigInteger(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    op.drop_column("tenants", "forgets")
