"""Proxies starting together on one new database migrate one at a time (proxy.store.db.upgrade).

The replicas of `docker compose up --scale proxy=3` each migrate at start. Measured in that stack
before the lock: two of three replicas failed their first migration with "duplicate key value
violates unique constraint pg_type_typname_nsp_index" (two processes creating the same table) and
served without a database until a retry.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from sqlalchemy import create_engine, text


def test_processes_migrating_one_new_database_at_once_all_succeed(new_database):
    url = new_database("atdp_race")
    script = textwrap.dedent(f"""
        import sys
        from proxy.store import db
        sys.stdin.readline()  # all released together
        db.upgrade({url!r})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for p in procs:  # every interpreter is up and waiting before any starts
        p.stdin.write("go\n")
    for p in procs:
        p.stdin.flush()
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(e[-2000:] for e in errors)
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT count(*) FROM alembic_version")) == 1
    finally:
        engine.dispose()
