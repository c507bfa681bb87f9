"""CPU time per proxied call, per process: the proxy, its writer child, the scripted upstream.

Throughput on a shared 2-core machine mostly measures the neighbours; CPU seconds spent per call
(user + system, from /proc, Linux only) move far less with load. Same set-up as proxy_overhead.py
(scripted upstream and `atdp serve` in their own processes, persistence on); warms up, sends --n
calls closed-loop at --concurrency, then waits for the writer to drain and reports ms of CPU per call
for each process during the load and including the drain.

  python bench/cpu_per_call.py [--n 3000] [--concurrency 32] [--stream | --no-stream]

Compare two checkouts by running each one's copy, interleaved (A, B, A, B ...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import httpx
from proxy_overhead import ROOT, free_port, run_round, scratch_database, wait_http


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    out = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                out += process_tree(int(child))
    return out


def label(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    if "proxy.cli serve" in cmd:
        return "proxy"
    if "resource_tracker" in cmd:
        return "resource tracker"
    if "spawn_main" in cmd:
        return "writer (child)"
    return "upstream" if "fake_vllm" in cmd else cmd[:40]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    db_url, drop = scratch_database()
    home = tempfile.mkdtemp(prefix="atdp-bench-")
    os.chmod(home, 0o755)
    up_port, proxy_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.fake_vllm", "--port", str(up_port)], cwd=ROOT, env=env)]
    penv = {**env, "ATDP_HOME": home, "ATDP_UPSTREAM_URL": f"http://127.0.0.1:{up_port}", "ATDP_OPEN_MODE": "1",
            "ATDP_DEFAULT_TENANT": "bench"}
    if db_url:
        penv["ATDP_DATABASE_URL"] = db_url
    procs.append(subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port", str(proxy_port),
                                   "--log-level", "warning"], cwd=ROOT, env=penv))
    health = f"http://127.0.0.1:{proxy_port}/healthz"
    try:
        wait_http(up_port)
        wait_http(proxy_port, "/healthz")
        deadline = time.monotonic() + 60
        while not httpx.get(health).json()["database"]:
            if time.monotonic() > deadline:
                raise RuntimeError("proxy has no database")
            time.sleep(0.2)
        asyncio.run(run_round(proxy_port, 400, args.concurrency, args.stream, 10_000_000))  # warm up
        while httpx.get(health).json()["writer_pending"]:
            time.sleep(0.2)
        pids = process_tree(procs[1].pid) + [procs[0].pid]
        before = {p: cpu_seconds(p) for p in pids}
        _, _, rps, errors = asyncio.run(run_round(proxy_port, args.n, args.concurrency, args.stream, 0))
        loaded = {p: cpu_seconds(p) for p in pids}
        while httpx.get(health).json()["writer_pending"]:
            time.sleep(0.2)
        drained = {p: cpu_seconds(p) for p in pids}
        print(f"{args.n} calls, concurrency {args.concurrency}, stream={args.stream}: {rps:.0f} req/s, {errors} errors; "
              f"load average {os.getloadavg()[0]:.1f}")
        print("| process | CPU ms/call during the load | CPU ms/call including the writer's drain |")
        print("| --- | --- | --- |")
        for p in pids:
            if drained[p] - before[p] > 0:
                print(f"| {label(p)} | {1000 * (loaded[p] - before[p]) / args.n:.3f} | "
                      f"{1000 * (drained[p] - before[p]) / args.n:.3f} |")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        drop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
