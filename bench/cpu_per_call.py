"""CPU time per proxied call, per process: the proxy, its writer child, the scripted upstream.

Throughput on a shared 2-core machine mostly measures the neighbours; CPU seconds spent per call
(user + system, from /proc, Linux only) move far less with load. Same set-up as proxy_overhead.py
(scripted upstream and `atdp serve` in their own processes, persistence on); warms up, sends --n
calls closed-loop at --concurrency, then waits for the writer to drain and reports ms of CPU per call
for each process during the load and including the drain.

  python bench/cpu_per_call.py [--n 3000] [--concurrency 32] [--stream | --no-stream] [--agent]
                                # --agent: Hermes' system prompt and 17 tool schemas in every call
  python bench/cpu_per_call.py --paced 20 --n 1000 --concurrency 64 [--stream-interval 4]
                                # tokens 20 ms apart, one per chunk (or 4: ATDP_STREAM_INTERVAL)
  python bench/cpu_per_call.py --with-provider-route [--rounds 6]   # the same proxy with and without a
                                                                    # LiteLLM provider route, interleaved

Compare two checkouts by running each one's copy, interleaved (A, B, A, B ...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import defaultdict

import httpx
from instructions_per_call import agent_body
from proxy_overhead import body_for, output_tokens_per_step, run_round, start_stack


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
    ap.add_argument("--with-provider-route", action="store_true",
                    help="compare the proxy without and with a provider route (rounds of --n/--rounds calls each)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--agent", action="store_true", help="agent-sized calls (Hermes' system prompt and tools)")
    ap.add_argument("--paced", type=float, metavar="MS", default=0.0,
                    help="the upstream streams one token per chunk, MS apart (a model generating), so each token "
                         "reaches the proxy in a read of its own; reports CPU per token too")
    ap.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="the proxy's ATDP_STREAM_INTERVAL: N tokens per chunk asked of the engine")
    args = ap.parse_args()
    if args.with_provider_route:
        return compare_routes(args)

    make_body = agent_body if args.agent else body_for
    paced = ["--chunk-size", "1", "--chunk-delay-ms", str(args.paced)] if args.paced else []
    stack = start_stack(upstream_args=paced, env={"ATDP_STREAM_INTERVAL": str(args.stream_interval)})
    procs, proxy_port = stack.procs, stack.proxy_port
    health = f"http://127.0.0.1:{proxy_port}/healthz"
    try:
        asyncio.run(run_round(proxy_port, 100 if args.paced else 400, args.concurrency, args.stream, 10_000_000,
                              make_body))  # warm up
        while httpx.get(health).json()["writer_pending"]:
            time.sleep(0.2)
        pids = process_tree(procs[1].pid) + [procs[0].pid]
        before = {p: cpu_seconds(p) for p in pids}
        _, _, rps, errors = asyncio.run(run_round(proxy_port, args.n, args.concurrency, args.stream, 0, make_body))
        loaded = {p: cpu_seconds(p) for p in pids}
        while httpx.get(health).json()["writer_pending"]:
            time.sleep(0.2)
        drained = {p: cpu_seconds(p) for p in pids}
        print(f"{args.n} {'agent-sized ' if args.agent else ''}calls, concurrency {args.concurrency}, "
              f"stream={args.stream}: {rps:.0f} req/s, {errors} errors; "
              f"load average {os.getloadavg()[0]:.1f}")
        tokens = output_tokens_per_step(stack.db_url) if args.paced else 0.0
        if tokens:
            print(f"{tokens:.1f} output tokens per call, {args.paced:g} ms apart, {args.stream_interval} per chunk")
        per_token = " | CPU us/token, including the drain" if tokens else ""
        print(f"| process | CPU ms/call during the load | CPU ms/call including the writer's drain{per_token} |")
        print("| --- | --- | --- |" + (" --- |" if tokens else ""))
        for p in pids:
            if drained[p] - before[p] > 0:
                spent = drained[p] - before[p]
                print(f"| {label(p)} | {1000 * (loaded[p] - before[p]) / args.n:.3f} | {1000 * spent / args.n:.3f} |"
                      + (f" {1e6 * spent / args.n / tokens:.1f} |" if tokens else ""))
    finally:
        stack.stop()
    return 0


def drain(port: int) -> None:
    while httpx.get(f"http://127.0.0.1:{port}/healthz").json()["writer_pending"]:
        time.sleep(0.2)


def compare_routes(args) -> int:
    """CPU per call of the proxy (and its writer) without and with a provider route, in alternating
    rounds, each round drained before the next (so each proxy's writer CPU is its own)."""
    stack = start_stack(provider_route=True)
    targets = [("no route", stack.proxy_port, stack.procs[1].pid), ("provider route", stack.routed_port,
                                                                      stack.procs[2].pid)]
    cpu: dict[str, dict[str, float]] = {name: defaultdict(float) for name, _, _ in targets}
    calls = dict.fromkeys(cpu, 0)
    per_round = max(args.concurrency, args.n // args.rounds)
    loads = []
    try:
        for _, port, _ in targets:
            asyncio.run(run_round(port, 400, args.concurrency, args.stream, 10_000_000))  # warm up
            drain(port)
        for k in range(args.rounds):
            for name, port, pid in targets:
                pids = process_tree(pid)
                before = {p: cpu_seconds(p) for p in pids}
                _, _, _, errors = asyncio.run(run_round(port, per_round, args.concurrency, args.stream, k * per_round))
                assert errors == 0, f"{errors} errors"
                drain(port)
                for p in pids:
                    cpu[name][label(p)] += cpu_seconds(p) - before[p]
                calls[name] += per_round
                loads.append(os.getloadavg()[0])
        print(f"{args.rounds} alternating rounds of {per_round} calls per proxy, concurrency {args.concurrency}, "
              f"stream={args.stream}; load average {min(loads):.1f}-{max(loads):.1f}")
        print("| process | CPU ms/call, no route | CPU ms/call, provider route |")
        print("| --- | --- | --- |")
        for proc in ("proxy", "writer (child)"):
            a, b = (1000 * cpu[name][proc] / calls[name] for name, _, _ in targets)
            print(f"| {proc} | {a:.3f} | {b:.3f} |")
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
