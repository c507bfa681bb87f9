"""How much CPU an idle vLLM engine takes from a trainer on the same cores (issue 15, item 7).

Starts vLLM (CPU, the tiny model), sends a few calls, then measures the CPU time of the engine's
whole process tree over windows in which nothing is sent: right after the calls, once settled,
paused (`POST /pause?mode=keep`, dev mode), and resumed. Figures are cores (CPU seconds per second).
On a machine shared with other work they are the engine's own use, not wall-clock effects.

  python bench/engine_idle_cpu.py [--window 20] [--out bench/results/engine_idle_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.demo.model_zoo import cached_tiny_model  # noqa: E402
from proxy.demo.vllm import VLLMServer, find_vllm_python  # noqa: E402


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue  # exited between listing and reading
        total += times.user + times.system
    return total


def cores_over(pid: int, seconds: float) -> float:
    start = tree_cpu_s(pid)
    time.sleep(seconds)
    return (tree_cpu_s(pid) - start) / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=20.0, help="seconds per measured window")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine_idle_cpu.json")
    args = ap.parse_args()
    python = find_vllm_python()
    if python is None:
        sys.exit("no vLLM environment: run scripts/vllm_env.sh")
    result: dict[str, float] = {}
    server = VLLMServer(python=python, model_dir=cached_tiny_model(seed=0), served_name="tiny",
                        env={"VLLM_SERVER_DEV_MODE": "1"})
    with server as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        assert srv.pid is not None
        def burst() -> None:
            for _ in range(8):
                client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 16})
        burst()
        result["right_after_calls"] = cores_over(srv.pid, args.window)
        burst()
        time.sleep(5.0)
        result["settled_idle"] = cores_over(srv.pid, args.window)
        client.post("/pause", params={"mode": "keep"}).raise_for_status()
        try:
            result["paused"] = cores_over(srv.pid, args.window)
        finally:
            client.post("/resume").raise_for_status()
        result["resumed_idle"] = cores_over(srv.pid, args.window)
    for name, cores in result.items():
        print(f"{name:18s} {cores:.3f} cores")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"window_s": args.window, "cores": result}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
