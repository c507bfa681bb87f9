"""A shared proxy's continuation lookup: the published keys alone, and with the stored steps (as now).

A proxy (`atdp serve`, ATDP_SHARED_LINKS=1, scripted upstream) serves --calls single-turn calls, so
their steps and keys are stored; then each query is timed on one connection, alternating, with 4
known and 4 unknown keys (a call's history holds some keys the database knows and some it does
not). Same database set-up as proxy_overhead.py (ATDP_DATABASE_URL, ATDP_TEST_DATABASE_URL's server,
or an embedded one).

  python bench/shared_lookup.py [--calls 3000] [--queries 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import psycopg
from proxy_overhead import ROOT, body_for, run_round, start_stack

# The lookup of a shared proxy before it read the stored steps too.
KEYS_ONLY = """
SELECT hash, kind, step_id, session_id, parent_step_id, history_len FROM continuation_links
WHERE hash = ANY(%(hashes)s::varchar[]) AND created_at > now() - make_interval(secs => %(ttl)s)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--queries", type=int, default=2000, help="of each query, alternating in rounds of 500")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # this checkout's lookup, whatever the environment has installed
    from proxy.store import links

    stack = start_stack(env={"ATDP_SHARED_LINKS": "1", "ATDP_DEFAULT_TENANT": "bench"})
    try:
        asyncio.run(run_round(stack.proxy_port, args.calls, 16, False, 0, body_for, "/v1/chat/completions"))
        with psycopg.connect(links.libpq_url(stack.db_url), autocommit=True) as conn:
            deadline = time.monotonic() + 60
            while conn.execute("SELECT count(*) FROM steps").fetchone()[0] < args.calls:  # the writer's lag
                assert time.monotonic() < deadline, "steps not stored"
                time.sleep(0.5)
            known = [r[0] for r in conn.execute("SELECT hash FROM continuation_links WHERE kind = 't'").fetchall()]
            conn.execute("ANALYZE")
            times: dict[str, list[float]] = {"keys only": [], "keys + stored steps": []}
            for _ in range(max(1, args.queries // 500)):
                for name, sql in (("keys only", KEYS_ONLY), ("keys + stored steps", links._LOOKUP)):
                    for _ in range(500):
                        hashes = random.sample(known, 4) + [f"{random.getrandbits(256):064x}" for _ in range(4)]
                        t0 = time.perf_counter()
                        found = conn.execute(sql, {"hashes": hashes, "ttl": 86400.0, "tenant": "bench"}).fetchall()
                        times[name].append((time.perf_counter() - t0) * 1e3)
                        assert len(found) == 4, found
            print(f"{args.calls} steps and their keys stored; {len(times['keys only'])} queries each, 4 known + 4 unknown keys")
            for name, ts in times.items():
                ts.sort()
                print(f"{name}: p50 {statistics.median(ts):.3f} ms, p99 {ts[int(len(ts) * 0.99)]:.3f} ms")
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
