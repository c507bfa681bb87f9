"""A keep-mode weight update's window on the engine, by pause route, next to vLLM's bare reload.

Starts vLLM (CPU, tiny model or SmolLM2, dev mode) and alternates two checkpoints, interleaving
three ways of putting them in place in each round (no proxy, no traffic):
    bare     `POST /collective_rpc reload_weights` alone (no pause, no tag): vLLM's own reload
    pause    `/pause?mode=keep`, reload, `/update_weight_version`, `/resume`, one after another
             (the proxy's sequence before; `/pause` answers 20 ms after the engine paused)
    tag-after  `/sleep?level=0`, the prefix reset beside the reload, then the tag, `/resume` (the
             proxy's sequence before the tag went beside the reload)
    sleep    `/sleep?level=0`, then the prefix reset, the reload and the tag together, `/resume`
             (the proxy's sequence for an engine without the extension)
    one      the proxy's way now (`proxy.rollout.engine_weights.update`): the same engine calls in
             one request, `POST /atdp/update_weights` (proxy/rollout/vllm_ext/atdp_update.py)
The window is from sending the pause to `/resume` answered: what a request in flight waits; for
`one`, from sending the request to its answer, which holds the engine's pause inside it.

  python bench/pause_routes.py [--model tiny|smollm2] [--rounds 5] [--swaps 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.rollout.engine_weights import Routes, from_checkpoint, update  # noqa: E402
from proxy.upstream import ReplicaPool  # noqa: E402


async def bare(c: httpx.AsyncClient, ckpt: str, name: str) -> float:
    t0 = time.perf_counter()
    (await c.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": ckpt}})
     ).raise_for_status()
    return time.perf_counter() - t0


async def pause(c: httpx.AsyncClient, ckpt: str, name: str) -> float:
    t0 = time.perf_counter()
    for route, kw in (("/pause", {"params": {"mode": "keep"}}),
                      ("/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": ckpt}}}),
                      ("/update_weight_version", {"json": {"new_version": name}}),
                      ("/resume", {})):
        (await c.post(route, **kw)).raise_for_status()
    return time.perf_counter() - t0


def proxy_path(pool: ReplicaPool, one_request: bool):
    async def run(c: httpx.AsyncClient, ckpt: str, name: str) -> float:
        pool.replicas[0].update_route = None if one_request else False
        t = await update(c, pool.replicas[0], from_checkpoint(ckpt, name), headers={}, timeout_s=120, mode="keep")
        assert ("atdp/update_weights" in t.steps) == one_request, t.steps
        return t.window_s  # one request: sent to answered, which holds the engine's own window
    return run


def tag_after_path(pool: ReplicaPool):
    async def run(c: httpx.AsyncClient, ckpt: str, name: str) -> float:
        async def load(routes: Routes) -> None:
            await routes.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": ckpt}})
            await routes.post("/update_weight_version", json={"new_version": name})

        t = await update(c, pool.replicas[0], load, headers={}, timeout_s=120, mode="keep")
        return t.window_s
    return run


def summary(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"n": len(s), "p50_ms": round(statistics.median(s) * 1000, 1), "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1000, 1)}


async def measure(base_url: str, dirs: list[str], rounds: int, swaps: int) -> dict:
    pool = ReplicaPool([base_url])
    ways = {"bare": bare, "pause": pause, "tag-after": tag_after_path(pool), "sleep": proxy_path(pool, False),
            "one": proxy_path(pool, True)}
    out: dict[str, list[float]] = {k: [] for k in ways}
    async with httpx.AsyncClient(base_url=base_url, timeout=300, trust_env=False) as c:
        for r in range(rounds):
            for way, fn in ways.items():
                for i in range(swaps):
                    out[way].append(await fn(c, dirs[i % 2], f"{way}{r}.{i}"))
                if swaps % 2:
                    await bare(c, dirs[0], "back")
            # the engine answers and carries the last tag
            info = (await c.get("/weight_info")).json()["weight_version"]
            assert info.startswith("one"), info
    res = {k: summary(v) for k, v in out.items()}
    for k in ("pause", "tag-after", "sleep", "one"):
        res[k]["over_bare_p50"] = round(res[k]["p50_ms"] / res["bare"]["p50_ms"], 2)
    return res


def main() -> None:
    from proxy.demo.model_zoo import cached_smollm2, cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--swaps", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args()
    python = find_vllm_python() or sys.exit("no vLLM environment: run scripts/vllm_env.sh")
    tmp = None
    if args.model == "tiny":
        dirs = [str(cached_tiny_model(seed=0)), str(cached_tiny_model(seed=1))]
    else:  # one checkpoint under two folders: a reload reads and prepares every weight all the same
        src = cached_smollm2()
        tmp = Path(tempfile.mkdtemp(prefix="atdp-pause-routes-"))
        shutil.copytree(src, tmp / "copy")
        dirs = [str(src), str(tmp / "copy")]
    print(f"load average before {os.getloadavg()}", flush=True)
    try:
        with VLLMServer(python=python, model_dir=Path(dirs[0]), served_name=args.model) as engine:
            result = asyncio.run(measure(engine.base_url, dirs, args.rounds, args.swaps))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {"model": args.model, "load_average_after": os.getloadavg(), **result}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
