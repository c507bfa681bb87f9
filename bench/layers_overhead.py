"""What harness and memory versions add to a call, measured side by side with a direct call and with
the same proxy's calls for a tenant that has no layers, interleaved in one run.

Starts the scripted upstream (tests/fake_vllm.py) and two `atdp serve` processes on one database:
proxy A's calls belong to tenant `bench` (no layers), proxy B's to tenant `bench-layers`, which has a
serving harness overlay (a system-prompt addition and a tool-description change) and a serving memory
of --facts facts. Every call of B's tenant is a new user turn, so each one searches memory (one
indexed full-text query) and gets the facts its question names prepended. Gates are off here
(ATDP_GATES=off): the bench measures serving, not evaluation.

  python bench/layers_overhead.py [--requests 1200] [--rounds 6] [--facts 2000]

Reports, at concurrency 1 and 32 (closed loop), non-streamed and streamed: p50/p99 of the direct
call, of proxy A and of proxy B, and what the layers add (B - A). Needs a PostgreSQL, found as
bench/proxy_overhead.py finds one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from proxy_overhead import free_port, q, run_round, start_stack, wait_database  # noqa: E402

ADMIN = "bench-admin-key"
TENANT = "bench-layers"
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
OVERLAY = {"system_append": "Prefer reading a module's README before its code.",
           "tools": {"read_file": {"description": "Read a file from the repository, by its path relative to the root."}}}


def fact(j: int) -> str:
    return f"Module {j} lives in src/mod{j} and is owned by team {uuid.uuid5(uuid.NAMESPACE_DNS, str(j)).hex[:6]}."


def body(i: int, stream: bool) -> dict:
    """bench/proxy_overhead.py's call, with a tool: distinct text every call; it names module i % 97."""
    return {"model": "fake", "stream": stream, "max_tokens": 64, "tools": TOOLS,
            "messages": [{"role": "system", "content": "You are a coding agent. Follow the repository rules."},
                         {"role": "user", "content": f"request {i} {uuid.uuid4().hex}: list the files in src/ "
                                                     f"and explain what module {i % 97} does, briefly."}]}


def post(port: int, path: str, payload: dict) -> dict:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}{path}", json=payload, timeout=300,
                   headers={"authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    return r.json()


def install_layers(port: int, n_facts: int) -> dict[str, str]:
    """The tenant's harness overlay and its memory, promoted (gates off); the names of the serving versions."""
    harness = post(port, "/atdp/v1/versions", {"layer": "harness", "tenant": TENANT, "overlay": OVERLAY, "wait": True})
    memory = None
    for start in range(0, n_facts, 200):  # each memory version adds its facts to the one serving
        memory = post(port, "/atdp/v1/versions", {"layer": "memory", "tenant": TENANT, "wait": True,
                                                  "facts": [fact(j) for j in range(start, min(n_facts, start + 200))]})
    assert harness["status"] == "serving" and memory is not None and memory["status"] == "serving", (harness, memory)
    return {"harness": harness["name"], "memory": memory["name"]}


def applied(port: int) -> dict[str, str | None]:
    """One call's layer headers: proof that proxy B applies both."""
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body(5, False), timeout=60,
                   headers={"authorization": "Bearer bench"})
    r.raise_for_status()
    return {k: r.headers.get(f"x-atdp-{k}-version") for k in ("harness", "memory")}


async def measure(targets: dict[str, int], requests: int, concurrency: int, stream: bool, rounds: int) -> dict:
    per_round = max(concurrency, requests // rounds)
    lat: dict[str, list[float]] = {name: [] for name in targets}
    rps: dict[str, list[float]] = {name: [] for name in targets}
    errors = dict.fromkeys(targets, 0)
    for k, port in enumerate(targets.values()):  # warm every path first
        await run_round(port, concurrency * 4, concurrency, stream, 10_000_000 * (k + 1), make_body=body)
    i = 0
    for _ in range(rounds):
        for name, port in targets.items():
            xs, _, r, err = await run_round(port, per_round, concurrency, stream, i, make_body=body)
            i += per_round
            lat[name].extend(xs)
            rps[name].append(r)
            errors[name] += err
    out: dict = {"concurrency": concurrency, "stream": stream, "requests_each": len(lat["direct"])}
    for name in targets:
        out[name] = {"p50_ms": q(lat[name], 0.5), "p99_ms": q(lat[name], 0.99), "rps": statistics.median(rps[name]),
                     "errors": errors[name]}
    out["layers_added_p50_ms"] = out["layers"]["p50_ms"] - out["proxy"]["p50_ms"]
    out["layers_added_p99_ms"] = out["layers"]["p99_ms"] - out["proxy"]["p99_ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1200, help="calls per target and scenario")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--facts", type=int, default=2000, help="facts in the tenant's memory")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "layers_overhead.json"))
    args = ap.parse_args()

    stack = start_stack(env={"ATDP_ADMIN_KEY": ADMIN, "ATDP_GATES": "off"})
    try:
        versions = install_layers(stack.proxy_port, args.facts)
        layered = free_port()
        home = os.path.join(stack.home, "layers")
        os.mkdir(home, 0o755)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "ATDP_HOME": home, "ATDP_OPEN_MODE": "1",
               "ATDP_DEFAULT_TENANT": TENANT, "ATDP_DATABASE_URL": stack.db_url, "ATDP_ADMIN_KEY": ADMIN,
               "ATDP_GATES": "off", "ATDP_UPSTREAM_URL": f"http://127.0.0.1:{stack.up_port}"}
        stack.procs.append(subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port", str(layered),
                                             "--log-level", "warning"], cwd=ROOT, env=env))
        wait_database(layered)
        deadline = time.monotonic() + 30
        while (headers := applied(layered)) != versions and time.monotonic() < deadline:
            time.sleep(0.5)
        assert headers == versions, f"proxy B serves {headers}, expected {versions}"
        print(f"tenant {TENANT}: harness {versions['harness']}, memory {versions['memory']} ({args.facts} facts)")
        targets = {"direct": stack.up_port, "proxy": stack.proxy_port, "layers": layered}
        results = []
        for concurrency, stream in ((1, False), (1, True), (32, False), (32, True)):
            r = asyncio.run(measure(targets, args.requests, concurrency, stream, args.rounds))
            results.append(r)
            print(f"c={concurrency:>2} stream={str(stream):5} " + " | ".join(
                f"{name} p50 {r[name]['p50_ms']:6.2f} p99 {r[name]['p99_ms']:6.2f} ms {r[name]['rps']:6.0f} rps"
                for name in targets) + f" | layers add p50 {r['layers_added_p50_ms']:+.2f} ms "
                f"p99 {r['layers_added_p99_ms']:+.2f} ms", flush=True)
        summary = {"results": results, "facts": args.facts, "versions": versions,
                   "machine": {"cores": os.cpu_count(), "load_avg_at_end": os.getloadavg()}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
        print()
        print("| concurrency | stream | direct p50 / p99 (ms) | proxy, no layers p50 / p99 | proxy, harness + memory "
              "p50 / p99 | layers add p50 / p99 (ms) | rps, no layers / layers |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in results:
            print(f"| {r['concurrency']} | {'yes' if r['stream'] else 'no'} | {r['direct']['p50_ms']:.2f} / "
                  f"{r['direct']['p99_ms']:.2f} | {r['proxy']['p50_ms']:.2f} / {r['proxy']['p99_ms']:.2f} | "
                  f"{r['layers']['p50_ms']:.2f} / {r['layers']['p99_ms']:.2f} | {r['layers_added_p50_ms']:+.2f} / "
                  f"{r['layers_added_p99_ms']:+.2f} | {r['proxy']['rps']:.0f} / {r['layers']['rps']:.0f} |")
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
