"""The writer's sustained steps/s and CPU per step, straight into PostgreSQL (no HTTP).

Feeds agent-sized captured steps (bench/agent_steps.py: many concurrent tool-using sessions, token
ids growing turn by turn) through the writer's own path, `Recorder.persist_now` (content addressing,
records, prefix storage, the insert transaction), in the writer's batches. Redaction is scaled
separately (its own workers: bench/redaction_throughput.py measures them), so here the redactor is a
pass-through and the figures are the writer's and PostgreSQL's own cost.

Reports per round: sustained steps/s (wall), the writer's CPU ms per step (this process, user+sys)
and PostgreSQL's CPU ms per step (the writer's own backend, from /proc: Linux, local server only),
steps per CPU-second of both (what one core would carry), and the load average. With --baseline REF
the same rounds run on that git ref too (its tree extracted to a temporary folder, its own
migrations), interleaved, so both sides share the load. With --writers K, K writer processes (one
per proxy process, as `atdp serve --workers K` runs them) each write their share of the sessions
into the one database, released together: steps/s is the fleet's, the CPU figures are summed.

  python bench/write_path.py --database-url postgresql://postgres@127.0.0.1:5432/postgres \
      [--baseline main] [--sessions 200] [--turns 30] [--rounds 2] [--batch 256] [--writers 2]
      [--statements]   # + PostgreSQL's CPU per statement of a batch (the backend's schedstat, Linux)
  python bench/write_path.py --embedded ...   # the same on the embedded PostgreSQL 18
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


class PassThrough:
    """The redaction workers' answer for text with nothing to redact: the value itself, no counts."""

    def redact_value(self, value, tenant, *, found=None, operator=False):
        return value, {}

    def redact_many(self, items, *, with_values=False, operator=None):
        return [(v, {}, []) if with_values else (v, {}) for _, v in items]

    def close(self) -> None:
        pass


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backend_pids(engine) -> list[int]:
    """The PostgreSQL backends `engine` connects, as it connects them (their CPU is read from /proc)."""
    from sqlalchemy import event

    pids: list[int] = []

    @event.listens_for(engine, "connect")
    def _pid(conn, _record) -> None:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            pids.append(cur.fetchone()[0])

    return pids


def backend_ns(pid: int) -> int:
    """Nanoseconds a PostgreSQL backend has run on a CPU (`/proc/<pid>/schedstat`, finer than /stat's ticks)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def time_statements(engine, pids: list[int]) -> dict[str, list[int]]:
    """statement (its first 60 characters) -> [backend CPU ns, executions], filled as `engine` runs
    them. COPY does not pass through these events: it is in the rest of the backend's CPU."""
    from sqlalchemy import event

    spent: dict[str, list[int]] = {}
    mark = [0]

    @event.listens_for(engine, "before_cursor_execute")
    def _before(conn, cursor, statement, params, context, many) -> None:
        mark[0] = backend_ns(pids[-1])

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn, cursor, statement, params, context, many) -> None:
        row = spent.setdefault(" ".join(statement.split())[:60], [0, 0])
        row[0] += backend_ns(pids[-1]) - mark[0]
        row[1] += 1

    return spent


def one_round(admin_url: str, sessions: int, turns: int, batch: int, seed: int, writers: int = 1) -> dict:
    """Create a database, migrate it with this tree's migrations, write the steps, measure, drop it.
    With `writers` > 1, that many writer processes (one per proxy, as `atdp serve --workers N` runs
    them) each write their share of the sessions (sticky routing: a session's steps reach one writer),
    released together; the round's wall is the first start to the last end."""
    import multiprocessing as mp

    from sqlalchemy import create_engine, make_url

    from proxy.store import db

    name = f"atdp_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(db.sqlalchemy_url(admin_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    # The database swapped, the rest kept (the embedded server's URL names its socket in the query).
    url = make_url(db.sqlalchemy_url(admin_url)).set(database=name).render_as_string(hide_password=False)
    try:
        db.upgrade(url)
        if writers == 1:
            parts = [_writer(url, sessions, turns, batch, seed, 0, 1, None, None)]
        else:
            ctx = mp.get_context("fork")
            start, results = ctx.Barrier(writers), ctx.Queue()
            procs = [ctx.Process(target=_writer, args=(url, sessions, turns, batch, seed, k, writers, start, results))
                     for k in range(writers)]
            for pr in procs:
                pr.start()
            parts = []
            while len(parts) < writers:  # a writer that died says so now, not after a 10-minute wait
                try:
                    parts.append(results.get(timeout=1.0))
                except queue.Empty:
                    if any(pr.exitcode not in (None, 0) for pr in procs):
                        raise RuntimeError(f"a writer process failed: exit codes {[pr.exitcode for pr in procs]}") from None
            for pr in procs:
                pr.join()
        engine = create_engine(url)
        with engine.connect() as c:
            written = c.exec_driver_sql("SELECT count(*) FROM steps").scalar_one()
        engine.dispose()
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
    n = sum(p["n"] for p in parts)
    wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    cpu, prep, pg = (sum(p[k] for p in parts) for k in ("cpu", "prep", "pg"))
    return {"steps": n, "written_total": written, "spooled": sum(p["spooled"] for p in parts), "writers": writers,
            "wall_s": round(wall, 3), "steps_per_s": round(n / wall, 1), "writer_cpu_ms_per_step": round(1000 * cpu / n, 3),
            "prepare_cpu_ms_per_step": round(1000 * prep / n, 3), "write_cpu_ms_per_step": round(1000 * (cpu - prep) / n, 3),
            "pg_cpu_ms_per_step": round(1000 * pg / n, 3),
            "cpu_bound_steps_per_s": round(n / (cpu + pg), 1) if cpu + pg else None,
            "load_avg_1m": os.getloadavg()[0], **_statements(parts, n)}


def _statements(parts: list[dict], n: int) -> dict:
    """The writers' per-statement PostgreSQL CPU, summed: us per step and ms per execution, and the
    rest of the backends' CPU (COPY, commit); {} unless measured."""
    if not all("statements" in p for p in parts):
        return {}
    spent: dict[str, list[int]] = {}
    for p in parts:
        for statement, (ns, runs) in p["statements"].items():
            row = spent.setdefault(statement, [0, 0])
            row[0] += ns
            row[1] += runs
    total = sum(p["pg_ns"] for p in parts)
    rows = {k: {"us_per_step": round(ns / n / 1e3, 1), "ms_per_execution": round(ns / runs / 1e6, 2), "executions": runs}
            for k, (ns, runs) in sorted(spent.items(), key=lambda kv: -kv[1][0])}
    rest = total - sum(ns for ns, _ in spent.values())
    return {"statements": rows, "pg_other_us_per_step": round(rest / n / 1e3, 1)}


def _writer(url: str, sessions: int, turns: int, batch: int, seed: int, k: int, writers: int, start, results) -> dict:
    """Writer `k` of `writers`: its sessions' steps through one Recorder, timed after `start` releases all."""
    from agent_steps import interleaved

    from proxy.governance.policy import TenantPolicy
    from proxy.record.recorder import Recorder
    from proxy.record.spool import Spool
    from proxy.store import db

    # As the writer child connects (custom plans); a baseline tree without that option: its default.
    try:
        engine = db.make_engine(url, pool_size=1, max_overflow=0, custom_plans=True)
    except TypeError:
        engine = db.make_engine(url, pool_size=1, max_overflow=0)
    backends = backend_pids(engine)
    spent = time_statements(engine, backends) if os.environ.get("ATDP_BENCH_STATEMENTS") else None
    steps = interleaved(random.Random(seed), tenant="bench", sessions=sessions, turns=turns)
    shard = {ext: i % writers for i, ext in enumerate(dict.fromkeys(st.session.external_id for st in steps))}
    steps = [st for st in steps if shard[st.session.external_id] == k]
    # The whole load is built up front (tens of millions of token ids); out of the collector's
    # sight, as the writer child freezes its start-up heap, or full collections walking it would
    # be most of what is measured. In production only the batch in flight is in memory.
    gc.collect()
    gc.freeze()
    with tempfile.TemporaryDirectory() as spool_dir:
        rec = Recorder(secret=b"bench-secret", factory=db.session_factory(engine), spool=Spool(Path(spool_dir)),
                       redactor=PassThrough(), policy_for=lambda s, tenant: TenantPolicy(), batch_size=batch)
        rec.persist_now(steps[:batch])  # connect (and read the forget counts), warm the caches
        counted = hasattr(rec.preparer, "seen")
        steps = steps[batch:]
        if start is not None:
            start.wait()
        pg0 = sum(proc_cpu(p) for p in backends)
        ns0 = sum(backend_ns(p) for p in backends)
        if spent is not None:
            spent.clear()  # the warm-up batch above is not counted
        cpu0, t0 = time.process_time(), time.perf_counter()
        prep = 0.0
        for i in range(0, len(steps), batch):
            # persist_now's two halves, timed apart: prepare (content addressing, records, token
            # prefixes) and the write (one transaction).
            chunk = steps[i : i + batch]
            c0 = time.process_time()
            # The forget counts the cache reflects, as persist_now passes them (a tree without them: none).
            seen = rec.preparer.seen(sorted({st.session.tenant for st in chunk})) if counted else None
            records = rec.prepare(chunk)
            prep += time.process_time() - c0
            if counted:
                rec._persist(records, seen, {st.step_id: st for st in chunk})
            else:
                rec._persist(records)
        t1, cpu = time.perf_counter(), time.process_time() - cpu0
        pg = sum(proc_cpu(p) for p in backends) - pg0
        pg_ns = sum(backend_ns(p) for p in backends) - ns0
        rec.spool.close()
    engine.dispose()
    out = {"n": len(steps), "t0": t0, "t1": t1, "cpu": cpu, "prep": prep, "pg": pg, "spooled": rec.stats["spooled"]}
    if spent is not None:
        out.update(statements=spent, pg_ns=pg_ns)
    if results is not None:
        results.put(out)
    return out


def redaction_cpu(sessions: int, turns: int, seed: int) -> dict:
    """CPU per step of the redaction the pass-through stands in for: every distinct content of the same
    agent steps through one in-process `Redactor` (what each redaction worker runs), process CPU time."""
    from agent_steps import interleaved

    from proxy.governance.redaction import RedactionConfig, Redactor
    from proxy.store.content import canonical

    steps = interleaved(random.Random(seed), tenant="bench", sessions=sessions, turns=turns)
    seen: dict[bytes, tuple[str, object]] = {}
    for st in steps:
        for value in [st.system, st.tools, st.action, *st.new_messages, *(r.content for r in st.tool_results)]:
            seen.setdefault(canonical(value), ("bench", value))
    redactor = Redactor(RedactionConfig(salt=b"bench-secret"))
    redactor.redact_many([("bench", "warm up: call me at jane@example.com")])
    items = list(seen.values())
    kb = sum(len(k) for k in seen) / 1024
    c0 = time.process_time()
    redactor.redact_many(items)
    cpu = time.process_time() - c0
    return {"steps": len(steps), "distinct_contents": len(items), "new_kb_per_step": round(kb / len(steps), 2),
            "redaction_cpu_ms_per_step": round(1000 * cpu / len(steps), 3),
            "redaction_cpu_ms_per_kb": round(1000 * cpu / kb, 3), "load_avg_1m": os.getloadavg()[0]}


def baseline_tree(ref: str, into: Path) -> Path:
    """`ref`'s tracked files in `into`, with this checkout's bench builders copied in."""
    root = HERE.parent
    archive = subprocess.run(["git", "-C", str(root), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for f in ("agent_steps.py", "write_path.py", "redaction_throughput.py"):
        shutil.copy(HERE / f, into / "bench" / f)
    return into


def run_in(tree: Path, args: argparse.Namespace, seed: int) -> dict:
    cmd = [sys.executable, str(tree / "bench" / "write_path.py"), "--single", "--database-url", args.database_url,
           "--sessions", str(args.sessions), "--turns", str(args.turns), "--batch", str(args.batch), "--seed", str(seed)]
    if args.writers != 1:
        cmd += ["--writers", str(args.writers)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if args.statements:  # an environment variable: a baseline tree without the option ignores it
        env["ATDP_BENCH_STATEMENTS"] = "1"
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--database-url", default=os.environ.get("ATDP_TEST_DATABASE_URL"), required=False)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--writers", type=int, default=1,
                    help="writer processes, each with its share of the sessions (one per proxy process)")
    ap.add_argument("--baseline", help="a git ref to measure side by side (e.g. main)")
    ap.add_argument("--statements", action="store_true",
                    help="also PostgreSQL's CPU per statement of the writer's batch (Linux: /proc/<pid>/schedstat)")
    ap.add_argument("--embedded", action="store_true",
                    help="on the embedded PostgreSQL (the README's default) instead of --database-url's server")
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--redaction", action="store_true",
                    help="instead: the CPU per step of redacting the same steps' contents (one in-process Redactor)")
    args = ap.parse_args()
    if args.embedded and not args.single:
        from proxy.store import db

        home = Path(tempfile.mkdtemp(prefix="atdp-bench-"))
        home.chmod(0o755)  # the embedded server runs as its own user when we are root
        args.database_url = db.embedded_url(home)
    if not args.database_url and not args.redaction:
        ap.error("--database-url (or ATDP_TEST_DATABASE_URL): a PostgreSQL server where databases may be created")
    if args.redaction:
        print(json.dumps(redaction_cpu(args.sessions, args.turns, args.seed)))
        return 0
    if args.single:
        print(json.dumps(one_round(args.database_url, args.sessions, args.turns, args.batch, args.seed, args.writers)))
        return 0
    trees = {"this checkout": HERE.parent}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        trees = {f"baseline ({args.baseline})": baseline_tree(args.baseline, Path(tmp.name)), **trees}
    results: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for label, tree in trees.items():
            res = run_in(tree, args, args.seed + r)
            results[label].append(res)
            print(f"round {r + 1} {label}: {json.dumps(res)}", flush=True)
    print(f"\n{args.sessions} sessions x {args.turns} turns, batches of {args.batch}, {os.cpu_count()} CPUs")
    print(f"{'':28} {'steps/s':>9} {'writer ms/step':>15} {'(prepare+write)':>16} {'pg ms/step':>11} {'steps per CPU-s':>18} {'load':>6}")
    for label, rows in results.items():
        for res in rows:
            print(f"{label:28} {res['steps_per_s']:>9} {res['writer_cpu_ms_per_step']:>15} "
                  f"{res['prepare_cpu_ms_per_step']:>7}+{res['write_cpu_ms_per_step']:<8} {res['pg_cpu_ms_per_step']:>11} {res['cpu_bound_steps_per_s']:>18} {res['load_avg_1m']:>6.1f}")
    for label, rows in results.items():
        measured = [res for res in rows if "statements" in res]
        if not measured:
            continue
        print(f"\nPostgreSQL CPU per statement, {label} (us per step, ms per execution; each round):")
        for statement in measured[0]["statements"]:
            cells = [res["statements"].get(statement, {}) for res in measured]
            print(f"  {' / '.join(str(c.get('us_per_step')) for c in cells):>16} us  "
                  f"{' / '.join(str(c.get('ms_per_execution')) for c in cells):>14} ms  {statement}")
        print(f"  {' / '.join(str(res['pg_other_us_per_step']) for res in measured):>16} us  {'':>14}     "
              "the rest (COPY of steps and tool_calls, commit)")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
