"""Each route of a keep-mode weight update, timed against one long request, directly on vLLM (no proxy).

Starts vLLM (CPU, tiny model, as the tests do), sends one long request (`--tokens` tokens, ignore_eos;
`--path generate` renders and calls `/inference/v1/generate`, as the proxy's token-in-token-out path
does; `chat` calls `/v1/chat/completions`), waits `--delay` seconds, then sends pause (`mode=keep`),
reload_weights, update_weight_version, resume and prints, per trial, when each route was sent and
answered and when the request ended (seconds from the request's start). A poller asks
`/is_paused` every 20 ms meanwhile: its slowest answer shows whether the API server answers at all
while the engine generates. Whether the update landed mid-request: the request's `weight_versions`
(generate path) name two versions.

  python bench/keep_pause_timing.py [--trials 3] [--tokens 1200] [--delay 0.5] [--path generate|chat] [--no-warmup]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MESSAGES = [{"role": "user", "content": "count the files"}]


def long_request(base: str, path: str, tokens: int, out: dict) -> None:
    with httpx.Client(base_url=base, timeout=300) as c:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "logprobs": True, "return_token_ids": True}  # what the proxy asks for
        if path == "generate":
            gen = c.post("/v1/chat/completions/render", json=body).json()
            gen = {**gen, "stream": False}
        out["t0"] = time.monotonic()
        if path == "generate":
            r = c.post("/inference/v1/generate", json=gen)
        else:
            r = c.post("/v1/chat/completions", json=body)
        out["t1"] = time.monotonic()
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out["n"] = len(choice.get("token_ids") or [])
        out["spans"] = choice.get("weight_versions")


def poll(base: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base, timeout=60) as c:
        while not stop.is_set():
            t = time.monotonic()
            c.get("/is_paused")
            out.append(time.monotonic() - t)
            time.sleep(0.02)


def trial(base: str, weights: Path, version: str, args: argparse.Namespace) -> dict:
    req: dict = {}
    worker = threading.Thread(target=long_request, args=(base, args.path, args.tokens, req))
    worker.start()
    while "t0" not in req and worker.is_alive():
        time.sleep(0.002)
    stop, lat = threading.Event(), []
    poller = threading.Thread(target=poll, args=(base, stop, lat))
    poller.start()
    time.sleep(args.delay)
    t0 = req["t0"]
    routes = []
    with httpx.Client(base_url=base, timeout=120) as c:
        for method, route, kw in (
            ("POST", "/pause", {"params": {"mode": "keep"}}),
            ("POST", "/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}}),
            ("POST", "/update_weight_version", {"json": {"new_version": version}}),
            ("POST", "/resume", {}),
        ):
            s = time.monotonic()
            c.request(method, route, **kw).raise_for_status()
            routes.append((route.strip("/"), round(s - t0, 3), round(time.monotonic() - t0, 3)))
    worker.join()
    stop.set()
    poller.join()
    return {"request_s": round(req["t1"] - t0, 3), "tokens": req.get("n"), "routes": routes,
            "spans": req.get("spans"), "is_paused_max_s": round(max(lat), 3) if lat else None,
            "is_paused_n": len(lat)}


def main() -> None:
    from proxy.demo.model_zoo import cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--tokens", type=int, default=1200)
    p.add_argument("--delay", type=float, default=0.5)
    p.add_argument("--path", choices=("generate", "chat"), default="generate")
    p.add_argument("--no-warmup", action="store_true", help="the first trial is the engine's first request")
    args = p.parse_args()
    weights = [cached_tiny_model(seed=1), cached_tiny_model(seed=0)]
    server = VLLMServer(python=find_vllm_python() or sys.exit("no vLLM environment"), model_dir=weights[1],
                        served_name="tiny", env={"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")})
    print(f"load average {os.getloadavg()}", flush=True)
    with server:
        if not args.no_warmup:
            long_request(server.base_url, args.path, 16, {})
        for i in range(args.trials):
            res = trial(server.base_url, weights[i % 2], f"v{i + 1}", args)
            print(json.dumps(res), flush=True)
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
