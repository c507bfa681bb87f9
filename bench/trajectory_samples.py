"""Step samples vs trajectory samples: the same update, timed in both layouts (issue 16, item 2).

Builds multi-turn sessions whose prompts extend each other token for token (as agents' plain-text
continuations do): turn t's prompt = turn t-1's prompt + output + `--new` fresh tokens (a tool
result, a user message). The behaviour logprobs are the model's own (an on-policy batch). Then one
optimizer step (`loss.train_step`, the trainer's code) on a fresh copy of the model, per mode:

    step        one sample per step: every turn re-reads the whole history
    trajectory  one sequence per session: the history is read once

and reports, per mode, the median over `--repeats` (the modes alternate): seconds per update,
tokens fed to the model, trained (output) tokens per second, and the loss; plus the largest
difference between the two modes' per-token logprobs (they must agree: same tokens, same context).

  python bench/trajectory_samples.py [--model tiny|smollm2] [--sessions 8] [--turns 4] [--prompt 256]
                                     [--new 64] [--output 48] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.batch import StepTokens, build_samples, micro_batches, session_weights  # noqa: E402
from trainer.loss import PPOOptions, group_advantages, token_logprobs, train_step  # noqa: E402
from trainer.model import load_model  # noqa: E402


def sessions(args, vocab: int) -> list[StepTokens]:
    """Prefix-exact multi-turn sessions of random tokens; rewards spread over [0, 1]."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    steps = []
    for k in range(args.sessions):
        prompt = rand(args.prompt)
        for t in range(args.turns):
            output = rand(args.output)
            steps.append(StepTokens(
                step_id=f"{k}-{t}", session_id=str(k), task_id="task", seq=t, prompt_ids=prompt, output_ids=output,
                behaviour_logprobs=[0.0] * len(output), output_versions=["v0"] * len(output),
                output_mask=[1] * len(output), prompt_exact=True, reward=k / max(args.sessions - 1, 1),
                version_lag=0))
            prompt = prompt + output + rand(args.new)
    return steps


@torch.no_grad()
def set_behaviour(model, steps: list[StepTokens]) -> None:
    """The model's own logprobs as the behaviour logprobs (one forward per step)."""
    for st in steps:
        ids = torch.tensor([st.prompt_ids + st.output_ids])
        st.behaviour_logprobs = token_logprobs(model, ids, torch.ones_like(ids))[0, len(st.prompt_ids):].tolist()


def batches(steps: list[StepTokens], mode: str, max_tokens: int):
    samples = session_weights(build_samples(steps, mode=mode, turn_discount=1.0, max_len=1 << 20), "token")
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True,
                           sessions=[s.session_id for s in samples], sizes=[len(s.step_ids) for s in samples])
    return samples, micro_batches(samples, adv, pad_id=0, max_tokens=max_tokens)


@torch.no_grad()
def output_logprobs(model, steps: list[StepTokens], mode: str) -> dict[tuple[str, int], float]:
    samples, _ = batches(steps, mode, 1 << 30)
    by_id = {st.step_id: st for st in steps}
    out = {}
    for smp in samples:  # one at a time: a padded batch's logits would be [B, T, vocab]
        ids = torch.tensor([smp.input_ids])
        logp = token_logprobs(model, ids, torch.ones_like(ids))[0]
        for sid in smp.step_ids:
            start = len(by_id[sid].prompt_ids)
            for j in range(len(by_id[sid].output_ids)):
                out[(sid, j)] = logp[start + j].item()
    return out


def one_update(base, steps: list[StepTokens], mode: str, max_tokens: int) -> dict:
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    samples, mbs = batches(steps, mode, max_tokens)
    t0 = time.perf_counter()
    stats = train_step(model, optimizer, mbs, PPOOptions(), rewards=[s.reward for s in samples])
    seconds = time.perf_counter() - t0
    fed = sum(len(s.input_ids) for s in samples)
    return {"samples": len(samples), "tokens_fed": fed, "tokens_padded": sum(mb["input_ids"].numel() for mb in mbs),
            "trained_tokens": int(stats["tokens"]), "seconds": seconds, "loss": stats["loss"],
            "grad_norm": stats["grad_norm"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256, help="first prompt's tokens")
    p.add_argument("--new", type=int, default=64, help="new prompt tokens per later turn")
    p.add_argument("--output", type=int, default=48, help="output tokens per turn")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()

    from proxy.demo.model_zoo import cached_smollm2, cached_tiny_model

    model_dir = cached_tiny_model(seed=0) if args.model == "tiny" else cached_smollm2()
    base = load_model(model_dir, dtype="fp32", grad_checkpointing=False).eval()
    steps = sessions(args, base.config.vocab_size)
    set_behaviour(base, steps)
    lp = {mode: output_logprobs(base, steps, mode) for mode in ("step", "trajectory")}
    worst = max(abs(lp["step"][k] - lp["trajectory"][k]) for k in lp["step"])

    runs: dict[str, list[dict]] = {"step": [], "trajectory": []}
    for r in range(args.repeats):
        for mode in (("step", "trajectory") if r % 2 == 0 else ("trajectory", "step")):
            runs[mode].append(one_update(base, steps, mode, args.micro_batch_tokens))
            print(mode, json.dumps(runs[mode][-1]), file=sys.stderr)

    result = {"model": args.model, "shape": {k: getattr(args, k) for k in
                                             ("sessions", "turns", "prompt", "new", "output", "repeats")},
              "torch_threads": torch.get_num_threads(), "load_average": [round(x, 1) for x in os.getloadavg()],
              "max_abs_logprob_diff_between_modes": worst}
    for mode, rs in runs.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        result[mode] = {**{k: rs[0][k] for k in ("samples", "tokens_fed", "tokens_padded", "trained_tokens")},
                        "seconds_median": round(seconds, 3), "seconds": [round(r["seconds"], 3) for r in rs],
                        "trained_tokens_per_s": round(rs[0]["trained_tokens"] / seconds, 1),
                        "fed_tokens_per_s": round(rs[0]["tokens_fed"] / seconds, 1), "loss": rs[0]["loss"],
                        "grad_norm": rs[0]["grad_norm"]}
    result["speedup"] = round(result["step"]["seconds_median"] / result["trajectory"]["seconds_median"], 2)
    result["loss_diff"] = abs(result["step"]["loss"] - result["trajectory"]["loss"])
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
