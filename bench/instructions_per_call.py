"""Instructions the proxy process executes per call, counted by valgrind (callgrind).

CPU seconds per call move with whatever else the machine runs (on a shared 2-core VM the same code
has measured 0.8 to 1.4 ms within minutes); an instruction count barely moves, so two checkouts can
be compared in one run each. The proxy runs under `valgrind --tool=callgrind` with instrumentation
off while it starts; the count covers only the measured calls (warm-up excluded), in the proxy's
process and every thread of it (the writer's sender thread included; the writer child runs
natively, as do the scripted upstream and the load generator). Same set-up as cpu_per_call.py
(scripted upstream, `atdp serve`, persistence on), the proxy about 30-50x slower, so use few calls.

  python bench/instructions_per_call.py [--n 300] [--concurrency 8] [--stream | --no-stream]
  python bench/instructions_per_call.py --tree ../other-checkout   # that checkout's proxy, this load
  python bench/instructions_per_call.py --agent   # Hermes' real system prompt and 17 tool schemas (46 KB)
  python bench/instructions_per_call.py --messages  # through /v1/messages (the proxy translates each chunk)
  python bench/instructions_per_call.py --paced 20 --n 40 --concurrency 2 [--stream-interval 4]
                                                  # tokens 20 ms apart (a model generating), one per
                                                  # chunk or 4 (ATDP_STREAM_INTERVAL): per token too
  python bench/instructions_per_call.py --writer  # instead: the writer child's instructions per step
                                                  # (redaction, records, the database writes; drain included)

Hashing runs in software under valgrind (no SHA extensions), so changes to hashing are timed, not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from proxy_overhead import ROOT, body_for, messages_body, output_tokens_per_step, run_round, start_stack


def callgrind(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=120)


def total_instructions(out_dir: Path, pid: int) -> int:
    """Instructions in the last dump of process `pid` (its `totals:` or `summary:` line)."""
    dumps = sorted(out_dir.glob(f"cg.{pid}.*"), key=lambda p: int(p.suffix[1:]))
    assert dumps, f"no callgrind dump in {out_dir}"
    for line in dumps[-1].read_text(errors="replace").splitlines():
        if m := re.match(r"(?:totals|summary): (\d+)", line):
            return int(m.group(1))
    raise RuntimeError(f"no totals in {dumps[-1]}")


@functools.cache
def hermes_content() -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.redaction_corpus import client_operator_content

    return client_operator_content()["hermes"]


def writer_pid(proxy_pid: int, timeout_s: float = 60.0) -> int:
    """The proxy's writer child (multiprocessing's spawn), valgrind-wrapped like its parent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{proxy_pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                    return int(child)
        time.sleep(0.5)
    raise RuntimeError("no writer child found")


def agent_body(i: int, stream: bool) -> dict:
    """The bench's call as Hermes sends it: its captured system prompt and tool schemas in front."""
    hermes = hermes_content()
    body = body_for(i, stream)
    body["messages"] = [*hermes["system"], *body["messages"][1:]]
    body["tools"] = hermes["tools"]
    return body


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--agent", action="store_true", help="agent-sized calls (Hermes' system prompt and tools)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose proxy runs (default: this one)")
    ap.add_argument("--writer", action="store_true", help="count the writer child instead of the proxy")
    ap.add_argument("--messages", action="store_true", help="through Anthropic's /v1/messages (translated chunks)")
    ap.add_argument("--paced", type=float, metavar="MS", default=0.0,
                    help="the upstream streams one token per chunk, MS apart, so each token is a read of its own "
                         "(keep concurrency x the proxy's time per token under MS: under valgrind it is 30-50x slower)")
    ap.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="the proxy's ATDP_STREAM_INTERVAL: N tokens per chunk asked of the engine")
    args = ap.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="callgrind-"))
    wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--trace-children={'yes' if args.writer else 'no'}",
            f"--callgrind-out-file={out_dir}/cg.%p"]
    paced = ["--chunk-size", "1", "--chunk-delay-ms", str(args.paced)] if args.paced else []
    stack = start_stack(wrap=wrap, tree=args.tree.resolve(), start_timeout_s=1800 if args.writer else 900,
                        upstream_args=paced, env={"ATDP_STREAM_INTERVAL": str(args.stream_interval)})
    pid, port = stack.procs[1].pid, stack.proxy_port
    if args.writer:
        pid = writer_pid(pid)
    health = f"http://127.0.0.1:{port}/healthz"
    try:
        make_body = agent_body if args.agent else messages_body if args.messages else body_for
        path = "/v1/messages" if args.messages else "/v1/chat/completions"
        asyncio.run(run_round(port, (2 if args.paced else 4) * args.concurrency, args.concurrency, args.stream,
                              10_000_000, make_body, path))  # warm up
        while httpx.get(health, timeout=60).json()["writer_pending"]:
            time.sleep(0.2)
        callgrind("-i", "on", str(pid))
        callgrind("-z", str(pid))
        _, _, rps, errors = asyncio.run(run_round(port, args.n, args.concurrency, args.stream, 0, make_body, path))
        if args.writer:  # its steps are written once the load is over: the drain is the writer's work
            while httpx.get(health, timeout=60).json()["writer_pending"]:
                time.sleep(0.2)
        callgrind("-d", str(pid))
        callgrind("-i", "off", str(pid))
        total = total_instructions(out_dir, pid)
        where = "the writer child, per step" if args.writer else "the proxy process"
        if args.paced and (tokens := output_tokens_per_step(stack.db_url)):  # none stored: no per-token figure
            where += f"; {tokens:.1f} output tokens per call, {total / args.n / tokens / 1e3:.1f} K instructions per token"
        print(f"{args.tree.resolve().name}: {args.n} calls, concurrency {args.concurrency}, stream={args.stream}, "
              f"{'agent-sized, ' if args.agent else ''}{'/v1/messages, ' if args.messages else ''}{errors} errors: {total / args.n / 1e6:.3f} M instructions per call in {where}")
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
