"""Does a long vLLM answer stop every other process on this machine? (vLLM alone, no proxy.)

A watcher process of its own sleeps 10 ms at a time and notes each wake-up more than `--stall`
seconds late: a process that is not scheduled (a stop of the whole process, not of one thread). Meanwhile
vLLM (CPU, tiny model) answers `--calls` requests of `--tokens` tokens one at a time (`ignore_eos`),
streamed or not, each after a keep-mode update when `--swap` (the proxy's sequence,
`proxy.rollout.engine_weights.update`, with the engine frozen before the request reaches it).
Prints each call's span and the stops.

  python bench/machine_stalls.py [--calls 4] [--tokens 1500] [--no-stream] [--swap]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WATCHER = """
import sys, time
last = time.monotonic(); end = last + float(sys.argv[1]); limit = float(sys.argv[2])
while time.monotonic() < end:
    time.sleep(0.01)
    now = time.monotonic()
    if now - last > limit:
        print(f"{last:.2f} {now - last:.2f}", flush=True)  # when the stop began, how long
    last = now
"""


def answer(base: str, tokens: int, stream: bool) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": stream, "logprobs": True, "return_token_ids": True}
    with httpx.Client(base_url=base, timeout=300, trust_env=False) as c, c.stream("POST", "/v1/chat/completions",
                                                                                  json=body) as r:
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass


def swap(base: str, checkpoint: str, name: str) -> None:
    from proxy.engine import EngineClient
    from proxy.rollout.engine_weights import from_checkpoint, update
    from proxy.upstream import ReplicaPool

    async def go() -> None:
        engine = EngineClient(120.0)
        try:
            await update(engine, ReplicaPool([base]).replicas[0], from_checkpoint(checkpoint, name), timeout_s=120,
                         mode="keep")
        finally:
            await engine.close()
    asyncio.run(go())


def main() -> None:
    from proxy.demo.model_zoo import cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--swap", action="store_true")
    p.add_argument("--stall", type=float, default=0.3, help="seconds late that count as a stop")
    args = p.parse_args()
    dirs = [str(cached_tiny_model(seed=0)), str(cached_tiny_model(seed=1))]
    calls = []
    with VLLMServer(python=find_vllm_python() or sys.exit("no vLLM environment"), model_dir=Path(dirs[0]),
                    served_name="tiny") as engine:
        answer(engine.base_url, 16, False)  # warm
        watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(args.calls * 60 + 30), str(args.stall)],
                                   stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        for i in range(args.calls):
            t0 = time.monotonic()
            if args.swap:  # frozen before the request arrives, so the update lands while it waits
                httpx.post(engine.base_url + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
                call = threading.Thread(target=answer, args=(engine.base_url, args.tokens, not args.no_stream))
                call.start()
                time.sleep(0.5)
                swap(engine.base_url, dirs[(i + 1) % 2], f"v{i + 1}")
                call.join()
            else:
                answer(engine.base_url, args.tokens, not args.no_stream)
            calls.append({"call": i, "from": round(t0, 2), "to": round(time.monotonic(), 2)})
            time.sleep(1.0)
        watcher.terminate()
        out, _ = watcher.communicate()
    stops = [{"from": float(a), "seconds": float(b)} for a, b in (line.split() for line in out.splitlines())]
    inside = [s for s in stops if any(c["from"] - 0.5 <= s["from"] <= c["to"] for c in calls)]
    print(json.dumps({"calls": calls, "stops": stops, "stops_during_calls": len(inside),
                      "longest_stop_s": max((s["seconds"] for s in stops), default=0.0),
                      "stream": not args.no_stream, "swap": args.swap, "tokens": args.tokens}, indent=2))


if __name__ == "__main__":
    main()
