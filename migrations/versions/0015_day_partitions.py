"""day partitions: steps and tool_calls partitioned by the session's id, one partition per UTC day

Revision ID: 0015
Revises: 0014

Retention forgets whole sessions; a session's internal id is a UUIDv7 minted when its first step is
written, so partitioning by `session_id` ranges puts each session, all its steps and tool calls, in the
partition of the day it began, and retention can drop a day whole instead of deleting its rows
(proxy.store.partitions, proxy.governance.forget). The existing rows are not copied: each table becomes
the partition `<table>_legacy` for the ids up to the end of the migration's day (rows of ids that
sort above that move to their day's partition, or `<table>_default`). Unique keys of a partitioned table
must hold the partition key: steps' primary key is (id, session_id), tool_calls' (step_id, call_id,
session_id); the foreign keys from tool_calls and feedback to steps(id), and from steps to sessions,
go (the writer upserts a session, then writes its steps and their calls, in one transaction; forget
deletes them explicitly; retention deletes a dropped day's session rows without a cascade into steps).
Views are bound to the tables they were created on, so every view is replaced by its own definition
once the new tables exist.
A database with nothing recorded yet gets no legacy partition: it is partitioned from its first day.
"""

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from alembic import op
from sqlalchemy import text

from proxy.store.partitions import AHEAD_DAYS, day_bound, id_range, name_of

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STEP_INDEXES = """
CREATE INDEX ix_steps_tenant_started ON steps (tenant_id, started_at);
CREATE INDEX ix_steps_model_version ON steps (model_version);
CREATE INDEX ix_steps_trainable ON steps (started_at) WHERE eligibility = 'eligible' AND trained_version_id IS NULL;
CREATE INDEX ix_steps_retention ON steps (retention_until) WHERE retention_until IS NOT NULL;
CREATE INDEX ix_steps_transcript_hash ON steps USING hash (transcript_hash);
"""
CALL_INDEXES = """
CREATE INDEX ix_tool_calls_name ON tool_calls (tenant_id, name);
CREATE INDEX ix_tool_calls_session_id ON tool_calls (session_id);
"""
KEYS = {  # table -> (primary key after, primary key before)
    "steps": ("id, session_id", "id"),
    "tool_calls": ("step_id, call_id, session_id", "step_id, call_id"),
}


def _views() -> list[tuple[str, str]]:
    """Every view of the schema with its definition, in creation order."""
    rows = op.get_bind().execute(text(
        "SELECT c.relname, pg_get_viewdef(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind = 'v' AND n.nspname = current_schema() ORDER BY c.oid"))
    return [(name, body) for name, body in rows]


def _rebind(views: list[tuple[str, str]]) -> None:
    for name, body in views:
        op.execute(f'CREATE OR REPLACE VIEW "{name}" AS {body}')


def _index_names(table: str) -> list[tuple[str, str | None, bool]]:
    """(index, the constraint it backs or None, whether it is a partition of a parent's index)."""
    return [tuple(r) for r in op.get_bind().execute(text(
        "SELECT i.relname, con.conname, EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = i.oid) "
        "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "LEFT JOIN pg_constraint con ON con.conindid = x.indexrelid AND con.conrelid = x.indrelid "
        "WHERE x.indrelid = CAST(:t AS regclass)"), {"t": table})]


def _keys_and_indexes() -> None:
    """What both directions build on the new tables besides their primary keys (the same names)."""
    op.execute("ALTER TABLE steps ADD CONSTRAINT uq_steps_session_seq UNIQUE (session_id, seq)")
    op.execute(STEP_INDEXES)
    op.execute(CALL_INDEXES)


def upgrade() -> None:
    today = datetime.now(UTC).date()
    bound = day_bound(today + timedelta(days=1))
    # A new database (nothing recorded yet) is partitioned from today on; one with data keeps it
    # where it is, as the legacy partition of the ids up to the end of today.
    empty = not op.get_bind().scalar(text("SELECT EXISTS (SELECT 1 FROM steps) OR EXISTS (SELECT 1 FROM tool_calls)"))
    views = _views()
    op.execute("ALTER TABLE tool_calls DROP CONSTRAINT IF EXISTS tool_calls_step_id_fkey")
    op.execute("ALTER TABLE feedback DROP CONSTRAINT IF EXISTS feedback_step_id_fkey")
    # Deleting a session row must not cascade into its steps row by row: retention deletes a dropped
    # day's session rows, and forget deletes a session's steps itself.
    op.execute("ALTER TABLE steps DROP CONSTRAINT IF EXISTS steps_session_id_fkey")
    for table, (key, _) in KEYS.items():
        legacy = f"{table}_legacy"
        op.execute(f"ALTER TABLE {table} RENAME TO {legacy}")
        for index, constraint, _ in _index_names(legacy):
            if constraint:
                op.execute(f'ALTER TABLE {legacy} RENAME CONSTRAINT "{constraint}" TO "{constraint}_legacy"')
            else:
                op.execute(f'ALTER INDEX "{index}" RENAME TO "{index}_legacy"')
        op.execute(f"CREATE TABLE {table} (LIKE {legacy} INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMPRESSION)"
                   " PARTITION BY RANGE (session_id)")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY ({key})")
    _keys_and_indexes()
    for i in range(0 if empty else 1, AHEAD_DAYS + 1):
        day = today + timedelta(days=i)
        lo, hi = id_range(day)
        for table in KEYS:
            op.execute(f"CREATE TABLE {name_of(table, day)} PARTITION OF {table} FOR VALUES FROM ('{lo}') TO ('{hi}')")
    for table in KEYS:
        op.execute(f"CREATE TABLE {table}_default PARTITION OF {table} DEFAULT")
    for table in () if empty else KEYS:
        legacy = f"{table}_legacy"
        # Ids above the legacy range (a day ahead, or not a UUIDv7 atdp minted) move to their partition.
        op.execute(f"INSERT INTO {table} SELECT * FROM {legacy} WHERE session_id >= '{bound}'")
        op.execute(f"DELETE FROM {legacy} WHERE session_id >= '{bound}'")
        op.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {table}_pkey_legacy")  # a partition has one key: the parent's
        op.execute(f"ALTER TABLE {table} ATTACH PARTITION {legacy} FOR VALUES FROM (MINVALUE) TO ('{bound}')")
        # The legacy table's own keys and indexes the parent's did not take over (its primary key on the
        # id alone, say): the parent's replace them.
        for index, constraint, attached in _index_names(legacy):
            if not attached:
                if constraint:
                    op.execute(f'ALTER TABLE {legacy} DROP CONSTRAINT "{constraint}"')
                else:
                    op.execute(f'DROP INDEX "{index}"')
    _rebind(views)
    if empty:
        op.execute("DROP TABLE steps_legacy, tool_calls_legacy")


def downgrade() -> None:
    views = _views()
    for table in KEYS:
        op.execute(f"CREATE TABLE {table}_flat (LIKE {table} INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMPRESSION)")
        op.execute(f"INSERT INTO {table}_flat SELECT * FROM {table}")
        op.execute(f"ALTER TABLE {table} RENAME TO {table}_parted")
        op.execute(f"ALTER TABLE {table}_flat RENAME TO {table}")
    _rebind(views)
    for table, (_, key) in KEYS.items():
        op.execute(f"DROP TABLE {table}_parted")  # its partitions with it
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY ({key})")
    _keys_and_indexes()
    op.execute("ALTER TABLE steps ADD CONSTRAINT steps_session_id_fkey FOREIGN KEY (session_id) "
               "REFERENCES sessions (id) ON DELETE CASCADE")
    op.execute("ALTER TABLE tool_calls ADD CONSTRAINT tool_calls_step_id_fkey FOREIGN KEY (step_id) "
               "REFERENCES steps (id) ON DELETE CASCADE")
    op.execute("ALTER TABLE feedback ADD CONSTRAINT feedback_step_id_fkey FOREIGN KEY (step_id) "
               "REFERENCES steps (id) ON DELETE CASCADE")
