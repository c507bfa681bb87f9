"""What a call's session linking costs as its conversation grows, on the request path.

Every call re-sends its whole history; the proxy parses it, computes a match key per message, the
rolling prefix hashes over those keys (`proxy.sessions`: the continuation index's keys) and the body's
retry fingerprint. Builds an agent-shaped body (a 7 KB system prompt, then per turn a tool call and a
1 KB tool result) of each length and reports microseconds per call for each part (best of 7 runs).

  python bench/session_hashing.py [--turns 1 10 50 100]
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.sessions import body_hash, match_key, prefix_hashes  # noqa: E402


def agent_body(turns: int, seed: int = 1) -> dict:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_letters + "  \n") for _ in range(n))

    messages: list[dict] = [{"role": "system", "content": text(7000)}]
    for i in range(turns):
        args = orjson.dumps({"command": text(60)}).decode()
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "terminal", "arguments": args}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": text(1000)})
    return {"model": "m", "messages": messages}


def best_us(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def row(turns: int) -> str:
    body = agent_body(turns)
    raw, messages = orjson.dumps(body), body["messages"]
    keys = [match_key(m) for m in messages]
    n = max(20, 2000 // (turns + 1))
    return (f"| {turns} | {len(raw) / 1024:.0f} | {best_us(lambda: orjson.loads(raw), n):.0f} "
            f"| {best_us(lambda: [match_key(m) for m in messages], n):.0f} "
            f"| {best_us(lambda: prefix_hashes('t', keys), n):.0f} | {best_us(lambda: body_hash('t', raw), n):.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 10, 50, 100])
    args = ap.parse_args()
    print("| turns | body KB | parse (us) | match keys (us) | prefix hashes (us) | body fingerprint (us) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for turns in args.turns:
        print(row(turns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
