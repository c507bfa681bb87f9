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
import time

import httpx
from proxy_overhead import run_round, start_stack


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

    stack = start_stack()
    procs, proxy_port = stack.procs, stack.proxy_port
    health = f"http://127.0.0.1:{proxy_port}/healthz"
    try:
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
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
