"""How stable is one trainer update? The e2e learning task, offline, over many seeds.

The e2e test (tests/e2e/test_learning_e2e.py) samples 128 one-turn answers of 6 tokens from the tiny
model through vLLM, rewards the fraction of tokens in S (the 16 tokens the base emitted most in
round 0), and runs one `atdp train --once` update per round. Its outcome is one draw. This script
runs the same loop in one process, sampling with torch instead of vLLM (so it is fast and exactly
on-policy), with the trainer's own batch and loss code, for several step-size settings and many
sampling seeds, and reports each round's mean reward: the distribution a single e2e run draws from.

  python bench/learning_dynamics.py [--seeds 8] [--first-seed 1] [--rounds 6] [--only TEXT] [--out FILE]

The seeds here are not the e2e test's (its answers come from vLLM with its own seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.demo.model_zoo import cached_tiny_model  # noqa: E402
from trainer.batch import StepTokens, build_samples, micro_batches  # noqa: E402
from trainer.loss import PPOOptions, add_proximal_logprobs, group_advantages, train_step  # noqa: E402
from trainer.model import load_model  # noqa: E402

SESSIONS, MAX_TOKENS = 128, 6


@dataclass
class Setting:
    name: str
    lr: float
    ppo_epochs: int
    keep_optimizer: bool
    engine_numerics: str | None = None  # trainer/numerics.py profile (the e2e trainer probes "bf16" or "bf16-trunc")


SETTINGS = [
    Setting("e2e today: lr 3e-3, 2 epochs, fresh AdamW", 3e-3, 2, False),
    Setting("lr 1e-3, 2 epochs, fresh", 1e-3, 2, False),
    Setting("lr 3e-3, 1 epoch, fresh", 3e-3, 1, False),
    Setting("lr 1e-3, 2 epochs, kept AdamW", 1e-3, 2, True),
    Setting("lr 3e-3, 2 epochs, kept AdamW", 3e-3, 2, True),
    Setting("lr 3e-3, 2 epochs, fresh, bf16 numerics", 3e-3, 2, False, "bf16"),
    Setting("lr 1e-3, 2 epochs, fresh, bf16 numerics", 1e-3, 2, False, "bf16"),
]


def prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Question {i}: say something."}],
                                           add_generation_prompt=True, tokenize=False) for i in range(SESSIONS)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def sample(model, prompt_ids: list[list[int]], seed: int, pad_id: int) -> tuple[list[list[int]], list[list[float]]]:
    """MAX_TOKENS tokens per prompt at temperature 1 (all prompts in one left-padded batch), with their
    logprobs from the trainer's own `token_logprobs` (no EOS stop: the e2e answers are all MAX_TOKENS
    long too)."""
    from trainer.loss import token_logprobs

    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=pad_id)[:, width:]
    outs, lps = [], []
    for p, o in zip(prompt_ids, out.tolist(), strict=True):
        full = torch.tensor([p + o])
        lp = token_logprobs(model, full, torch.ones_like(full))[0, len(p):]
        outs.append(o)
        lps.append(lp.tolist())
    return outs, lps


def run(setting: Setting, base: Path, seed: int, rounds: int) -> list[float]:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = load_model(base, dtype="fp32", grad_checkpointing=False, engine_numerics=setting.engine_numerics)
    prompt_ids = prompts(tokenizer)
    opts = PPOOptions()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=setting.lr, weight_decay=0.0)
    subset: set[int] = set()
    means = []
    for rnd in range(rounds):
        model.eval()
        outs, lps = sample(model, prompt_ids, seed=1000 * seed + rnd, pad_id=tokenizer.pad_token_id or 0)
        if rnd == 0:
            subset = {t for t, _ in Counter(t for o in outs for t in o).most_common(16)}
        rewards = [sum(t in subset for t in o) / len(o) for o in outs]
        means.append(statistics.fmean(rewards))
        if rnd == rounds - 1:
            break
        steps = [StepTokens(step_id=str(i), session_id=str(i), task_id=None, seq=0, prompt_ids=prompt_ids[i],
                            output_ids=outs[i], behaviour_logprobs=lps[i], output_versions=["v"] * MAX_TOKENS,
                            output_mask=[1] * MAX_TOKENS, prompt_exact=True, reward=rewards[i], version_lag=0)
                 for i in range(SESSIONS)]
        samples = build_samples(steps, mode="step", turn_discount=1.0, max_len=4096)
        adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True,
                               sessions=[s.session_id for s in samples])
        mbs = micro_batches(samples, adv, pad_id=0, max_tokens=8192)
        if not setting.keep_optimizer:  # `atdp train --once` with fresh state: a new AdamW per update
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=setting.lr,
                                          weight_decay=0.0)
        if setting.ppo_epochs > 1:
            add_proximal_logprobs(model, mbs)
        for _ in range(setting.ppo_epochs):
            train_step(model, optimizer, mbs, opts, rewards=rewards)
    return means


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", default="", help="run only the settings whose name contains this text")
    ap.add_argument("--first-seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = cached_tiny_model()
    report = {}
    for setting in (s for s in SETTINGS if args.only in s.name):
        runs = [run(setting, base, seed, args.rounds) for seed in range(args.first_seed, args.first_seed + args.seeds)]
        gains = [statistics.fmean(r[-3:]) - r[0] for r in runs]
        first = [r[1] - r[0] for r in runs]
        report[setting.name] = {"runs": [[round(x, 3) for x in r] for r in runs],
                                "last3_minus_base": [round(g, 3) for g in gains],
                                "first_update_change": [round(f, 3) for f in first]}
        print(f"{setting.name}: last 3 - base: median {statistics.median(gains):+.3f}, min {min(gains):+.3f}, "
              f">= 0.1 in {sum(g >= 0.1 for g in gains)}/{len(gains)}; first update: min {min(first):+.3f}",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
