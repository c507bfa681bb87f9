"""Bytes on disk per stored session, against the session's unique text.

Builds agent sessions (bench/agent_steps.py: 100 turns by default), writes them through the writer
(`Recorder.persist_now`, pass-through redactor) into a fresh database, and reports
`pg_total_relation_size` of every table (heap + TOAST + indexes) before and after, per session,
with the index share. One session alone is dominated by empty tables' first pages, so --sessions N
writes N of them and divides: the steady cost of one more session.

Goal (issue 17): <= 1.5x the unique text + 4 bytes per stored token id.

  python bench/storage.py --database-url postgresql://postgres@127.0.0.1:5432/postgres [--sessions 20] [--turns 100]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SIZES = """
SELECT c.relname, pg_total_relation_size(c.oid), pg_indexes_size(c.oid),
       coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0)
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND NOT c.relispartition
"""
INDEXES = """
SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid)
       + coalesce((SELECT sum(pg_relation_size(h.inhrelid)) FROM pg_inherits h WHERE h.inhparent = i.indexrelid), 0)
  FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'public' AND c.relname IN ('contents', 'steps', 'tool_calls')
"""
PARTITIONED = """
SELECT p.relname, sum(pg_total_relation_size(c.oid)), sum(pg_indexes_size(c.oid)),
       sum(coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0))
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
 WHERE p.relkind = 'p' AND c.relkind = 'r'
 GROUP BY p.relname
"""
BY_KIND = """
SELECT kind, count(*), sum(size), sum(pg_column_size(body)), sum(pg_column_size(c.*)) FROM contents c
 GROUP BY kind ORDER BY 4 DESC
"""
STEP_COLUMNS = """
SELECT sum(pg_column_size(s.*)), sum(pg_column_size(prompt_token_ids)), sum(pg_column_size(output_token_ids)),
       sum(pg_column_size(output_logprobs)), sum(pg_column_size(message_hashes)), count(*)
  FROM steps s
"""


def sizes(conn) -> dict[str, tuple[int, int, int]]:
    """table -> (total, indexes, TOAST) bytes; heap = total - indexes - TOAST."""
    out = {name: (int(total), int(idx), int(toast)) for name, total, idx, toast in conn.exec_driver_sql(SIZES)}
    for name, total, idx, toast in conn.exec_driver_sql(PARTITIONED):  # a partitioned table: its partitions
        old = out.get(name, (0, 0, 0))
        out[name] = (old[0] + int(total), old[1] + int(idx), old[2] + int(toast))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--database-url", default=os.environ.get("ATDP_TEST_DATABASE_URL"))
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    if not args.database_url:
        ap.error("--database-url (or ATDP_TEST_DATABASE_URL): a PostgreSQL server where databases may be created")

    from agent_steps import session_steps, unique_text_bytes
    from sqlalchemy import create_engine
    from write_path import PassThrough

    from proxy.governance.policy import TenantPolicy
    from proxy.record.recorder import Recorder
    from proxy.record.spool import Spool
    from proxy.store import db

    name = f"atdp_storage_{uuid.uuid4().hex[:10]}"
    admin = create_engine(db.sqlalchemy_url(args.database_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = db.sqlalchemy_url(args.database_url).rsplit("/", 1)[0] + f"/{name}"
    try:
        db.upgrade(url)
        engine = db.make_engine(url, isolation_level="AUTOCOMMIT")
        rng = random.Random(args.seed)
        sessions = [session_steps(rng, tenant="bench", turns=args.turns) for _ in range(args.sessions)]
        text = sum(unique_text_bytes(s) for s in sessions)
        with engine.connect() as c:
            before = sizes(c)
        with tempfile.TemporaryDirectory() as spool_dir:
            rec = Recorder(secret=b"bench-secret", factory=db.session_factory(engine), spool=Spool(Path(spool_dir)),
                           redactor=PassThrough(), policy_for=lambda s, tenant: TenantPolicy())
            for steps in sessions:
                rec.persist_now(steps)
            rec.spool.close()
        with engine.connect() as c:
            c.exec_driver_sql("VACUUM ANALYZE")  # visibility maps and statistics, as autovacuum would leave them
            after = sizes(c)
            index_sizes = dict(c.exec_driver_sql(INDEXES).all())
            kinds = c.exec_driver_sql(BY_KIND).all()
            columns = c.exec_driver_sql(STEP_COLUMNS).first()
            ids = c.exec_driver_sql(
                "SELECT sum(cardinality(prompt_token_ids) + cardinality(output_token_ids)) FROM steps").scalar_one()
        engine.dispose()
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    n = args.sessions
    grown = {k: tuple(a - b for a, b in zip(after[k], before.get(k, (0, 0, 0)), strict=True)) for k in after}
    total = sum(v[0] for v in grown.values())
    indexes = sum(v[1] for v in grown.values())
    toast = sum(v[2] for v in grown.values())
    ids = int(ids or 0)
    goal = 1.5 * text + 4 * ids
    print(f"{n} sessions x {args.turns} turns; per session: unique text {text / n / 1024:.1f} KB, "
          f"stored token ids {ids / n:.0f}")
    kb = n * 1024
    print(f"{'table':24} {'KB/session':>11} {'heap':>8} {'TOAST':>8} {'indexes':>8}")
    for k, (tot, idx, tst) in sorted(grown.items(), key=lambda kv: -kv[1][0]):
        if tot:
            print(f"{k:24} {tot / kb:>11.1f} {(tot - idx - tst) / kb:>8.1f} {tst / kb:>8.1f} {idx / kb:>8.1f}")
    print(f"{'total':24} {total / kb:>11.1f} {(total - indexes - toast) / kb:>8.1f} {toast / kb:>8.1f} "
          f"{indexes / kb:>8.1f}")
    print("indexes (KB/session; an empty table's first pages included): " + ", ".join(
        f"{name} {size / kb:.1f}" for name, size in sorted(index_sizes.items(), key=lambda kv: -kv[1])))
    print("contents by kind (KB/session): kind, rows, raw JSON, stored body, stored row")
    for kind, rows, raw, body, row in kinds:
        print(f"  {kind:12} {rows / n:>6.0f} {raw / n / 1024:>8.1f} {body / n / 1024:>8.1f} {row / n / 1024:>8.1f}")
    row, prompt, output, logprobs, hashes, count = columns
    print(f"steps (KB/session): rows {row / n / 1024:.1f} = prompt ids {prompt / n / 1024:.1f} + output ids "
          f"{output / n / 1024:.1f} + logprobs {logprobs / n / 1024:.1f} + message hashes {hashes / n / 1024:.1f} "
          f"+ the rest {(row - prompt - output - logprobs - hashes) / n / 1024:.1f} ({count / n:.0f} rows)")
    print(f"stored / unique text: {total / text:.2f}x; goal (1.5x text + 4 B per token id): "
          f"{goal / n / 1024:.1f} KB/session -> {'met' if total <= goal else 'missed'} "
          f"({total / goal:.2f} of the goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
