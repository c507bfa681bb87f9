"""The GPU check of the NCCL weight-transfer path (ATDP_WEIGHT_TRANSFER=nccl). Not run on the CPU
machines this project is built on: it needs two CUDA GPUs (NCCL refuses two ranks on one device,
so the engine takes GPU 0 and the trainer process GPU 1) and a CUDA build of vLLM 0.32.

  python bench/gpu_weight_transfer.py --vllm-python /path/to/cuda-vllm/bin/python [--out FILE]

What it does, in about 2-5 minutes (the engine's cold start dominates):
1. builds the tiny seed-0 and seed-1 checkpoints (proxy.demo.model_zoo; no download) and starts vLLM
   on GPU 0 with the seed-0 weights, dev mode and `--weight-transfer-config {"backend":"nccl"}`;
2. records the greedy answers of a few prompts, then reloads seed 1 from disk through the proxy's
   own code (proxy.rollout.engine_weights, keep mode) for the reference answers and the disk
   window, and goes back to seed 0;
3. starts a trainer process (the vLLM python, GPU 1) that loads the seed-1 weights, joins the
   engine's group (trainer.weight_transfer.NcclSender.connect) and writes `weight_transfer.json`;
4. runs the proxy's swap path with `source_for(..., "nccl")` (pause keep, start_weight_update,
   update_weights, finish_weight_update, resume) while the trainer broadcasts;
5. checks: `/weight_info` names the new version, and the greedy answers equal the seed-1 reference
   (and differ from seed 0). Prints the timings: the NCCL window, the disk window, the broadcast.
Exit status 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["hello there", "what is 12 + 7?", "the quick brown fox", "say a number"]

# Runs in the trainer process (the vLLM python, GPU 1): join, declare, wait for "go", broadcast.
TRAINER = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
from trainer.weight_transfer import NcclSender, update_info, write_transfer_file

engine, ckpt, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.cuda.set_device(0)
state = {}
for f in sorted(__import__("pathlib").Path(ckpt).glob("*.safetensors")):
    state.update(load_file(str(f), device="cuda"))
sender = NcclSender(engine, master_port=port)
t0 = time.perf_counter(); sender.connect(); joined = time.perf_counter() - t0
write_transfer_file(__import__("pathlib").Path(ckpt), update_info(state))
print(json.dumps({"ready": True, "join_s": round(joined, 4)}), flush=True)
sys.stdin.readline()
t0 = time.perf_counter(); sender.broadcast(state); sent = time.perf_counter() - t0
print(json.dumps({"broadcast_s": round(sent, 4), "tensors": len(state),
                  "bytes": sum(t.numel() * t.element_size() for t in state.values())}), flush=True)
sender.close()
"""


def greedy(base_url: str) -> list[str]:
    out = []
    for p in PROMPTS:
        r = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 16})
        r.raise_for_status()
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


async def proxy_update(base_url: str, source, fallback) -> dict:
    from proxy.rollout.engine_weights import update
    from proxy.upstream import ReplicaPool

    replica = ReplicaPool([base_url]).replicas[0]
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        t = await update(client, replica, source, headers={}, timeout_s=600, mode="keep", fallback=fallback)
    return {"window_s": t.window_s, "routes_s": t.steps}


def main() -> int:
    import shutil
    import tempfile

    from proxy.demo.model_zoo import cached_tiny_model
    from proxy.demo.vllm import VLLMServer, free_port
    from proxy.rollout.engine_weights import from_checkpoint, source_for

    p = argparse.ArgumentParser()
    p.add_argument("--vllm-python", required=True, help="a python with a CUDA build of vLLM 0.32")
    p.add_argument("--out")
    args = p.parse_args()
    probe = subprocess.run([args.vllm_python, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    gpus = int(probe.stdout.strip() or 0)
    if gpus < 2:
        print(f"needs 2 CUDA GPUs (found {gpus}): NCCL refuses two ranks on one device", file=sys.stderr)
        return 2
    s0, s1 = cached_tiny_model(seed=0), cached_tiny_model(seed=1)
    result: dict = {"gpus": gpus}
    with tempfile.TemporaryDirectory() as tmp:
        sent_ckpt = Path(tmp) / "v1"
        shutil.copytree(s1, sent_ckpt)  # the trainer reads its weights here and declares the transfer
        server = VLLMServer(python=args.vllm_python, model_dir=s0, served_name="tiny", dtype="float32",
                            extra_args=["--weight-transfer-config", json.dumps({"backend": "nccl"}),
                                        "--gpu-memory-utilization", "0.2"],
                            env={"CUDA_VISIBLE_DEVICES": "0"})
        t0 = time.perf_counter()
        with server:
            result["engine_start_s"] = round(time.perf_counter() - t0, 1)
            base = server.base_url
            before = greedy(base)
            disk = asyncio.run(proxy_update(base, from_checkpoint(str(s1), "disk-v1"), from_checkpoint(str(s0), "s0")))
            reference = greedy(base)
            asyncio.run(proxy_update(base, from_checkpoint(str(s0), "s0"), None))
            result["disk"] = disk
            trainer = subprocess.Popen(
                [args.vllm_python, "-c", TRAINER, base, str(sent_ckpt), str(free_port())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(ROOT),
                env={**os.environ, "CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": str(ROOT)})
            try:
                ready = json.loads(trainer.stdout.readline() or "{}")
                if not ready.get("ready"):
                    print("the trainer process did not join the group", file=sys.stderr)
                    return 1
                result["join_s"] = ready["join_s"]
                source = source_for(str(sent_ckpt), "v1", "nccl")
                trainer.stdin.write("go\n")
                trainer.stdin.flush()
                result["nccl"] = asyncio.run(proxy_update(base, source, from_checkpoint(str(s0), "s0")))
                result.update(json.loads(trainer.stdout.readline() or "{}"))
            finally:
                trainer.stdin.close()
                trainer.wait(60)
            after = greedy(base)
            info = httpx.get(base + "/weight_info", timeout=10).json()
    checks = {
        "weight_info_names_v1": info.get("weight_version") == "v1",
        "routes_were_the_transfer_routes": "update_weights" in result["nccl"]["routes_s"],
        "greedy_equals_seed1_from_disk": after == reference,
        "greedy_changed_from_seed0": after != before,
    }
    result["checks"] = checks
    result["nccl_window_over_disk_window"] = round(result["nccl"]["window_s"] / result["disk"]["window_s"], 2)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
