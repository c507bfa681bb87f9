"""Retention of a due day: dropping its partitions (migration 0015) against deleting its rows.

Two fresh databases hold the same load: `--sessions` agent sessions of `--turns` steps
(bench/agent_steps.py) begun `--days-back` days ago, due under a 30-day policy, and as many begun
today, which stay. One is at migration 0014 (plain tables: retention deletes the due sessions' rows),
the other at head (day partitions: retention drops the due day's). Both run the same retention job
(`forget.run_retention`) and report its wall time and PostgreSQL backend CPU, the WAL it wrote, what
`steps` and `tool_calls` hold afterwards (size, dead rows), and the VACUUM that cleans up after it.
The databases run one after the other on the same server (WAL is the cluster's).

  python bench/retention.py --database-url postgresql://postgres@127.0.0.1:5432/postgres \
      [--sessions 100] [--turns 30] [--days-back 40]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from write_path import PassThrough, backend_pids, proc_cpu  # noqa: E402

SIZES = """
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0), coalesce(sum(s.n_dead_tup), 0), coalesce(sum(s.n_live_tup), 0)
  FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
 WHERE c.relkind = 'r' AND (c.relname IN ('steps', 'tool_calls') OR c.relname LIKE 'steps\\_%' OR c.relname LIKE 'tool\\_calls\\_%')
"""


def one(admin_url: str, revision: str, sessions: int, turns: int, days_back: int, seed: int) -> dict:
    from agent_steps import interleaved
    from sqlalchemy import create_engine, text

    from proxy.governance import forget
    from proxy.governance.policy import TenantPolicy
    from proxy.record import recorder as recorder_module
    from proxy.record.recorder import Recorder
    from proxy.record.spool import Spool
    from proxy.store import db, partitions
    from proxy.store.ids import new_id, uuid7_at

    name = f"atdp_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(db.sqlalchemy_url(admin_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = db.sqlalchemy_url(admin_url).rsplit("/", 1)[0] + f"/{name}"
    now = datetime.now(UTC)
    old = now - timedelta(days=days_back)
    try:
        db.upgrade(url, revision)
        engine = db.make_engine(url, pool_size=1, max_overflow=0)
        backends = backend_pids(engine)

        factory = db.session_factory(engine)
        if revision == "head":
            with factory() as s, s.begin():
                partitions.ensure(s, today=old.date(), ahead=0)
        policy = lambda s, tenant: TenantPolicy(retention_days=30)  # noqa: E731
        with tempfile.TemporaryDirectory() as spool_dir:
            rec = Recorder(secret=b"bench-secret", factory=factory, spool=Spool(Path(spool_dir)),
                           redactor=PassThrough(), policy_for=policy, batch_size=256)
            for when, mint in ((old, lambda: uuid7_at(int(old.timestamp() * 1000))), (now, new_id)):
                steps = interleaved(random.Random(seed), tenant="bench", sessions=sessions, turns=turns)
                base = steps[0].started_at
                for st in steps:  # the due day's steps started that day
                    st.started_at = when + (st.started_at - base)
                recorder_module.new_id = mint  # the writer mints session ids: at that day
                for i in range(0, len(steps), 256):
                    rec._persist(rec.prepare(steps[i : i + 256]))
                seed += 1
            recorder_module.new_id = new_id
            rec.spool.close()
        auto = create_engine(url, isolation_level="AUTOCOMMIT")  # VACUUM runs outside a transaction
        with auto.connect() as c:
            c.exec_driver_sql("VACUUM ANALYZE")  # both start clean
            steps_before = c.exec_driver_sql("SELECT count(*) FROM steps").scalar_one()
            size0, _, _ = c.execute(text(SIZES)).one()
            wal0 = c.exec_driver_sql("SELECT pg_current_wal_lsn()").scalar_one()
        pg0 = sum(proc_cpu(p) for p in backends)
        t0 = time.perf_counter()
        with factory() as s, s.begin():
            reports = forget.run_retention(s, policy_for=policy, now=now, quiet_s=3600)
        wall = time.perf_counter() - t0
        pg = sum(proc_cpu(p) for p in backends) - pg0
        engine.dispose()  # a backend that exits reports its table statistics (dead rows) at once
        with auto.connect() as c:
            wal = c.execute(text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :a)"), {"a": wal0}).scalar_one()
            time.sleep(0.5)
            size1, dead1, live1 = c.execute(text(SIZES)).one()
            v0 = time.perf_counter()
            c.exec_driver_sql("VACUUM steps, tool_calls")
            vacuum = time.perf_counter() - v0
            size2, _, _ = c.execute(text(SIZES)).one()
            steps_after = c.exec_driver_sql("SELECT count(*) FROM steps").scalar_one()
        auto.dispose()
        [r] = reports
        return {"schema": "0014 (plain tables: rows deleted)" if revision != "head" else "head (day partitions: dropped)",
                "steps_before": steps_before, "steps_after": steps_after, "forgotten_steps": r.steps,
                "forgotten_sessions": r.sessions, "contents_deleted": r.contents, "partitions_dropped": r.partitions,
                "retention_wall_s": round(wall, 3), "retention_pg_cpu_s": round(pg, 3),
                "wal_mb": round(float(wal) / 1e6, 2),
                "steps_and_calls_mb_before": round(float(size0) / 1e6, 2), "after_retention_mb": round(float(size1) / 1e6, 2),
                "dead_rows_after": int(dead1), "live_rows_after": int(live1),
                "vacuum_s": round(vacuum, 3), "after_vacuum_mb": round(float(size2) / 1e6, 2)}
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--days-back", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    for revision in ("0014", "head"):
        print(json.dumps(one(args.database_url, revision, args.sessions, args.turns, args.days_back, args.seed)),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
