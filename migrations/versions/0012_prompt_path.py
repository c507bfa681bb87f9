"""steps.prompt_path: how each step's prompt was built

Revision ID: 0012
Revises: 0010
Token-in-token-out (proxy/tito.py): a continuation of a step the proxy served is sent as the parent's
exact prompt+output ids followed by the new turn; a call whose history the client edited, or the
first call of a session, is rendered from its messages. The column says which: 'tito' | 'rendered';
NULL for provider calls and for steps recorded before this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("steps", sa.Column("prompt_path", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("steps", "prompt_path")
