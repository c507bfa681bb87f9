"""One demo-sized update with an idle vLLM beside the trainer, and with it stopped (issue 15, item 7).

The demo runs the trainer on the cores vLLM serves from; `bench/engine_idle_cpu.py` measured that an
idle engine takes ~0.01 cores, so pausing it should save nothing. This measures the update itself:

1. start vLLM (SmolLM2-135M by default, as the demo), answer `--steps` demo-like questions at
   temperature 1 (max 24 tokens, logprobs and token ids, as the proxy records them);
2. with the engine up and idle, run the update `--repeats` times, each in a fresh process as
   `atdp train --once` does: load the fp32 model, one decoupled-PPO step (`loss.train_step`) on
   those steps, write the fp32 checkpoint;
3. stop the engine, run the same updates again on the same data.

Reports each update's wall time (process start to exit) and its phases, the engine tree's CPU
seconds during the idle updates, and the load average before each: on a machine shared with
other work the difference between the arms is only meaningful next to the load.

  python bench/colocated_update.py [--model smollm2|tiny] [--steps 72] [--repeats 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTIONS = ["What is {a} + {b}?", "Compute {a} * {b}.", "What is {a} minus {b}?", "Add {a} and {b}, then say done."]


def sample(base_url: str, n: int) -> list[dict]:
    import httpx

    rows = []
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for i in range(n):
            q = QUESTIONS[i % len(QUESTIONS)].format(a=3 + 7 * i % 90, b=11 + 13 * i % 70)
            body = client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "system", "content": "You are a careful assistant."},
                                           {"role": "user", "content": q}],
                "max_tokens": 24, "temperature": 1.0, "seed": i, "logprobs": True, "return_token_ids": True,
            }).json()
            choice = body["choices"][0]
            rows.append({"prompt": body["prompt_token_ids"], "output": choice["token_ids"],
                         "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]], "reward": (i % 3) / 2})
    return rows


def worker(model_dir: str, data: str, out_dir: str) -> None:
    """One update in this process, the way `atdp train --once` runs it; prints its phases as JSON."""
    t0 = time.perf_counter()
    import torch

    from trainer.batch import StepTokens, build_samples, micro_batches, session_weights
    from trainer.checkpoint import gather_full_state_dict, write_checkpoint
    from trainer.loss import PPOOptions, group_advantages, train_step
    from trainer.model import load_model

    rows = json.loads(Path(data).read_text())
    steps = [StepTokens(step_id=str(i), session_id=str(i), task_id=f"t{i // 8}", seq=0, prompt_ids=r["prompt"],
                        output_ids=r["output"], behaviour_logprobs=r["logprobs"],
                        output_versions=["base"] * len(r["output"]), output_mask=[1] * len(r["output"]),
                        prompt_exact=True, reward=r["reward"], version_lag=0) for i, r in enumerate(rows)]
    t_import = time.perf_counter()
    model = load_model(model_dir, dtype="fp32", grad_checkpointing=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=8e-5)
    t_load = time.perf_counter()
    samples = session_weights(build_samples(steps, mode="step", turn_discount=1.0, max_len=512), "token")
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True,
                           sessions=[s.session_id for s in samples])
    stats = train_step(model, optimizer, micro_batches(samples, adv, pad_id=0, max_tokens=8192), PPOOptions())
    t_train = time.perf_counter()
    write_checkpoint(gather_full_state_dict(model), base_dir=Path(model_dir), out_dir=Path(out_dir), dtype="fp32")
    t_write = time.perf_counter()
    print(json.dumps({"import_s": t_import - t0, "load_s": t_load - t_import, "train_s": t_train - t_load,
                      "write_s": t_write - t_train, "tokens": stats["tokens"],
                      "mean_abs_logp_diff": stats["mean_abs_logp_diff"]}))


def tree_cpu_s(pid: int) -> float:
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def one_update(model_dir: Path, data: Path, out: Path) -> dict:
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", str(model_dir), str(data), str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    phases = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 2), **{k: round(v, 2) for k, v in phases.items()}, "load_avg_before": load}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    p.add_argument("--steps", type=int, default=72, help="the demo's round: 48 sessions, up to 2 steps, 25%% held out")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for vLLM to start (busy machines)")
    p.add_argument("--out")
    args = p.parse_args()

    from proxy.demo.model_zoo import cached_smollm2, cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    python = find_vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run scripts/vllm_env.sh")
    model_dir = cached_smollm2() if args.model == "smollm2" else cached_tiny_model(seed=0)
    result: dict = {"model": args.model, "steps": args.steps, "cpus": os.cpu_count(), "idle": [], "stopped": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "steps.json"
        with VLLMServer(python=python, model_dir=model_dir, served_name="m", ready_timeout=args.start_timeout) as server:
            data.write_text(json.dumps(sample(server.base_url, args.steps)))
            time.sleep(5)  # past the worker's 1 s busy-poll after the last call
            for r in range(args.repeats):
                before = tree_cpu_s(server.pid)
                row = one_update(model_dir, data, Path(tmp) / f"idle{r}")
                row["engine_cpu_s"] = round(tree_cpu_s(server.pid) - before, 2)
                result["idle"].append(row)
                print("idle", json.dumps(row), file=sys.stderr)
        for r in range(args.repeats):
            row = one_update(model_dir, data, Path(tmp) / f"stopped{r}")
            result["stopped"].append(row)
            print("stopped", json.dumps(row), file=sys.stderr)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
