"""Shared fixtures: a real PostgreSQL database per test session (fresh each run).

With ATDP_TEST_DATABASE_URL (e.g. postgresql://postgres@127.0.0.1:5432/postgres, as .ci/run sets)
the tests create their databases on that server; otherwise on an embedded PostgreSQL in a
temporary ATDP_HOME.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from proxy.store import db

pytest_plugins = ["tests.vllm_fixtures", "tests.proxy_fixtures"]


@pytest.fixture(scope="session")
def pg_admin_url(tmp_path_factory) -> str:
    url = os.environ.get("ATDP_TEST_DATABASE_URL")
    if url:
        return db.sqlalchemy_url(url)
    return _swap_db(db.embedded_url(outside_tmp("atdp-home")), "postgres")


@pytest.fixture(scope="session")
def every_server(pg_admin_url) -> list[str]:
    """An admin URL of each PostgreSQL the suite reaches: the test server and the embedded one (the
    README's path; PostgreSQL 18 against the machine's 15), for tests of what a planner chooses."""
    urls = [pg_admin_url]
    if os.environ.get("ATDP_TEST_DATABASE_URL"):
        urls.append(_swap_db(db.embedded_url(outside_tmp("atdp-home")), "postgres"))
    return urls


def outside_tmp(prefix: str) -> Path:
    """A temporary folder outside pytest's basetemp, which pytest keeps at mode 0700 and which the
    embedded PostgreSQL (run by its own system user when we are root) could not traverse."""
    path = Path(tempfile.mkdtemp(prefix=prefix + "-"))
    path.chmod(0o755)
    return path


def _swap_db(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def new_database(pg_admin_url):
    """Factory: a new empty database on the test server; all are dropped at the end."""
    created: list[str] = []
    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")

    def make(prefix: str = "atdp_test") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        created.append(name)
        return _swap_db(pg_admin_url, name)

    yield make
    with admin.connect() as conn:
        for name in created:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture(scope="session")
def db_url(new_database) -> str:
    """One migrated database shared by the test session (tests isolate by tenant/session ids)."""
    url = new_database()
    db.upgrade(url)
    return url


@pytest.fixture(scope="session")
def engine(db_url):
    e = db.make_engine(db_url)
    yield e
    e.dispose()


@pytest.fixture(scope="session")
def factory(engine):
    return db.session_factory(engine)


@pytest.fixture
def own_db(new_database):
    """A migrated database of the test's own (url, session factory): for tests that count whole tables."""
    url = new_database("atdp_own")
    db.upgrade(url)
    engine = db.make_engine(url)
    yield url, db.session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random tiny Llama (untied) for trainer tests, built once per module."""
    from tests.trainer_tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "base", seed=0, tied=False)


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"
