"""Closed-loop throughput with 1, 2 and 3 proxy processes on one database, side by side in one run.

  python bench/proxy_overhead.py --processes 1,2,3 [--requests 2000] [--rounds 4]

The stand-in upstream (tests/fake_vllm.py) and the first `atdp serve` come from
`proxy_overhead.start_stack`; the other proxies are more `atdp serve` processes on the same
database, each with its home and writer, every one with shared continuation links on (as several
proxies need them). A cell with k processes drives 32 keep-alive connections spread round robin
over the first k proxies (connection i to proxy i mod k), as a load balancer would; the cells take
turns in each round, so machine noise hits them alike. Also the direct upstream, for its ceiling.
Everything runs on this machine: the proxies, their writers, the upstream, PostgreSQL and the
load generator share its cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from proxy_overhead import (
    ROOT,
    Conn,
    body_for,
    encode,
    free_port,
    q,
    start_stack,
    steps_written,
    wait_database,
)

CONCURRENCY = 32


async def closed_loop(ports: list[int], n: int, start: int) -> tuple[list[float], float, int]:
    """`n` calls on CONCURRENCY connections spread over `ports`; (latencies, calls/s, non-200s)."""
    conns = [Conn(ports[i % len(ports)]) for i in range(CONCURRENCY)]
    await asyncio.gather(*(c.open() for c in conns))
    lat: list[float] = []
    errors = 0
    counter = iter(range(start, start + n))

    async def worker(c: Conn) -> None:
        nonlocal errors
        for i in counter:
            _, total, status = await c.request(encode(c.port, "/v1/chat/completions", body_for(i, False)), False)
            errors += status != 200
            lat.append(total)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return lat, n / elapsed, errors


async def measure(cells: dict[str, list[int]], requests: int, rounds: int) -> dict[str, dict]:
    per_round = max(CONCURRENCY, requests // rounds)
    res: dict[str, tuple[list[float], list[float], int]] = {name: ([], [], 0) for name in cells}
    i = 0
    for k, ports in enumerate(cells.values()):  # warm every connection path first
        await closed_loop(ports, CONCURRENCY * 4, 10_000_000 * (k + 1))
    for _ in range(rounds):
        for name, ports in cells.items():
            lat, rps, err = await closed_loop(ports, per_round, i)
            i += per_round
            lats, rpss, errs = res[name]
            lats.extend(lat)
            rpss.append(rps)
            res[name] = (lats, rpss, errs + err)
    return {name: {"rps": statistics.median(rpss), "rps_rounds": [round(x) for x in rpss], "p50_ms": q(lats, 0.5),
                   "p99_ms": q(lats, 0.99), "calls": len(lats), "errors": errs}
            for name, (lats, rpss, errs) in res.items()}


def run(processes: list[int], requests: int, rounds: int, out: str) -> int:
    shared = {"ATDP_SHARED_LINKS": "1"}
    stack = start_stack(env=shared)
    try:
        ports = [stack.proxy_port]
        base_env = {**os.environ, "PYTHONPATH": str(ROOT), "ATDP_UPSTREAM_URL": f"http://127.0.0.1:{stack.up_port}",
                    "ATDP_OPEN_MODE": "1", "ATDP_DEFAULT_TENANT": "bench", "ATDP_DATABASE_URL": stack.db_url, **shared}
        for k in range(1, max(processes)):
            home = os.path.join(stack.home, f"proxy-{k}")  # removed with the stack's home
            os.mkdir(home, 0o755)
            port = free_port()
            stack.procs.append(subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
                                                 "--log-level", "warning"], cwd=ROOT,
                                                env={**base_env, "ATDP_HOME": home}))
            wait_database(port)
            ports.append(port)
        cells = {"direct": [stack.up_port], **{f"{k} proxy": ports[:k] for k in processes}}
        load_before = os.getloadavg()
        results = asyncio.run(measure(cells, requests, rounds))
        load_after = os.getloadavg()
        t_end = time.monotonic()
        while True:  # every proxied call must become a step: wait for the writers
            healths = [httpx.get(f"http://127.0.0.1:{p}/healthz").json() for p in ports]
            if all(h["writer_pending"] == 0 and not h["spool_pending"] for h in healths) or time.monotonic() - t_end > 300:
                break
            time.sleep(0.2)
        proxied = sum(r["calls"] for name, r in results.items() if name != "direct")
        proxied += sum(CONCURRENCY * 4 for name in cells if name != "direct")
        written = steps_written(stack.db_url)
        summary = {"concurrency": CONCURRENCY, "results": results, "proxied_calls": proxied,
                   "steps_in_database": written, "writer_drain_seconds": time.monotonic() - t_end,
                   "machine": {"cores": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": load_after},
                   "shared_links": True}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=2))
        print(f"closed loop, concurrency {CONCURRENCY}, {rounds} interleaved rounds; load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} cores)")
        print("| target | req/s (median of rounds) | p50 / p99 (ms) | errors |")
        print("| --- | --- | --- | --- |")
        for name, r in results.items():
            print(f"| {name} | {r['rps']:.0f} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | {r['errors']} |")
        print(f"steps in PostgreSQL: {written} of {proxied} proxied calls; wrote {out}")
    finally:
        stack.stop()
    return 0
