"""A seeded store behind the real proxy, for the console's benchmark and screenshots.

A scratch database (on `--database-url`'s server, else ATDP_TEST_DATABASE_URL's, else an embedded
PostgreSQL in a temporary home), bulk-seeded by `tests/console_seed.py`, the proxy app (`create_app`,
the code `atdp serve` runs) on uvicorn in a thread, and the scripted vLLM stand-in as its upstream.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from proxy.app import create_app  # noqa: E402
from proxy.auth import create_key  # noqa: E402
from proxy.config import Settings  # noqa: E402
from proxy.store import db  # noqa: E402
from tests.console_seed import seed  # noqa: E402
from tests.fake_vllm import FakeVLLM, ServerThread  # noqa: E402


@dataclass
class ConsoleStack:
    url: str  # the proxy
    admin_key: str
    tenant_keys: dict[str, str]
    database_url: str
    seed_seconds: float


@contextmanager
def scratch_database(server_url: str | None) -> Iterator[str]:
    if not server_url:
        home = Path(tempfile.mkdtemp(prefix="atdp-console-bench-"))
        home.chmod(0o755)  # the embedded server may run as its own user
        yield db.embedded_url(home)
        return
    name = f"atdp_console_{uuid.uuid4().hex[:8]}"
    admin = create_engine(db.sqlalchemy_url(server_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(db.sqlalchemy_url(server_url)).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextmanager
def console_stack(sessions: int, server_url: str | None = None,
                  tenants: tuple[str, ...] = ("acme", "globex")) -> Iterator[ConsoleStack]:
    server_url = server_url or os.environ.get("ATDP_TEST_DATABASE_URL")
    with scratch_database(server_url) as url, tempfile.TemporaryDirectory(prefix="atdp-console-home-") as home:
        db.upgrade(url)
        engine = db.make_engine(url)
        t0 = time.perf_counter()
        seed(engine, sessions=sessions, tenants=tenants)
        seeded = time.perf_counter() - t0
        factory = db.session_factory(engine)
        with factory() as s, s.begin():
            keys = {t: create_key(s, t, name="console bench")[1] for t in tenants}
        admin_key = "atdp-admin-" + secrets.token_urlsafe(16)
        fake = FakeVLLM()
        with ServerThread(fake) as upstream:
            fake.url = upstream.url
            settings = Settings(home=Path(home), database_url=url, upstream_urls=[upstream.url], open_mode=False,
                                default_tenant=tenants[0], secret=b"console-bench", admin_key=admin_key,
                                writer_mode="thread")
            app = create_app(settings)
            with ServerThread(app) as proxy:
                state, versions = app.state.atdp, app.state.versions
                deadline = time.monotonic() + 120
                while state.factory is None or not versions.ready.is_set():
                    if time.monotonic() > deadline:
                        raise RuntimeError("the proxy did not connect to its database and replica in 120 s")
                    time.sleep(0.05)
                yield ConsoleStack(url=proxy.url, admin_key=admin_key, tenant_keys=keys, database_url=url,
                                   seed_seconds=seeded)
        engine.dispose()
