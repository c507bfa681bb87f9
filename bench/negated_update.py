"""Does one update on negated rewards make the tiny model measurably worse, as the replay gate sees it?

The gate test (tests/integration/test_negated_rewards_vllm.py) records the e2e learning task's
sessions (128 one-turn answers of 6 tokens, sampled at temperature 1; reward: the fraction of output
tokens in S, the 16 tokens those answers used most), holds a share of them out, trains one version on
the *negated* rewards of the rest, and expects the replay gate to reject it: the held-out prompts are
answered greedily by both versions and scored by the same rule. This script measures, offline and
over many seeds, how often that happens for a few trainer settings, so the test's settings come from
this measurement and not from the test's own outcome. The opposite update (the true rewards) is run
alongside as a check that the gate does not reject every update.

Sampling and the update use torch with the trainer's own batch and loss code (as
bench/learning_dynamics.py does); the greedy answers are decoded to text and encoded again before
scoring, as the test's evaluator scores the engine's text. The gate's verdict is
proxy.evaluation.stats.decide with max_regression 0.05 (`--max-regression` to change it), one tenant.

  python bench/negated_update.py [--seeds 20] [--first-seed 1] [--out FILE]
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
sys.path.insert(0, str(ROOT / "bench"))

from learning_dynamics import MAX_TOKENS, SESSIONS, prompts, sample  # noqa: E402

from proxy.demo.model_zoo import cached_tiny_model  # noqa: E402
from proxy.evaluation.stats import Pair, decide  # noqa: E402
from trainer.batch import StepTokens, build_samples, micro_batches  # noqa: E402
from trainer.loss import PPOOptions, add_proximal_logprobs, group_advantages, train_step  # noqa: E402
from trainer.model import load_model  # noqa: E402

HELD_OUT = 32  # of the SESSIONS prompts, the last HELD_OUT are held out (about the test's 25%)


@dataclass(frozen=True)
class Setting:
    name: str
    lr: float
    ppo_epochs: int


SETTINGS = [Setting("lr 1e-3, 2 epochs (the e2e's)", 1e-3, 2), Setting("lr 3e-3, 2 epochs", 3e-3, 2),
            Setting("lr 1e-2, 2 epochs", 1e-2, 2), Setting("lr 1e-2, 4 epochs (the gate test's)", 1e-2, 4)]


@torch.no_grad()
def greedy_scores(model, tokenizer, prompt_ids: list[list[int]], subset: set[int]) -> list[float]:
    scores = []
    for p in prompt_ids:
        out = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_TOKENS,
                             pad_token_id=tokenizer.pad_token_id or 0)[0, len(p):].tolist()
        eos = tokenizer.eos_token_id
        if eos in out:  # the engine stops at the end token and does not show it
            out = out[: out.index(eos)]
        ids = tokenizer(tokenizer.decode(out, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
        scores.append(sum(t in subset for t in ids) / len(ids) if ids else 0.0)
    return scores


def run(setting: Setting, base: Path, seed: int, *, negate: bool, max_regression: float) -> dict[str, float | bool]:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = load_model(base, dtype="fp32", grad_checkpointing=False, engine_numerics="bf16")
    prompt_ids = prompts(tokenizer)
    model.eval()
    outs, lps = sample(model, prompt_ids, seed=1000 * seed, pad_id=tokenizer.pad_token_id or 0)
    subset = {t for t, _ in Counter(t for o in outs for t in o).most_common(16)}
    rewards = [sum(t in subset for t in o) / len(o) for o in outs]
    train = range(SESSIONS - HELD_OUT)
    held = prompt_ids[SESSIONS - HELD_OUT:]
    before = greedy_scores(model, tokenizer, held, subset)
    given = [-r if negate else r for r in rewards]
    steps = [StepTokens(step_id=str(i), session_id=str(i), task_id=None, seq=0, prompt_ids=prompt_ids[i],
                        output_ids=outs[i], behaviour_logprobs=lps[i], output_versions=["v"] * MAX_TOKENS,
                        output_mask=[1] * MAX_TOKENS, prompt_exact=True, reward=given[i], version_lag=0)
             for i in train]
    samples = build_samples(steps, mode="step", turn_discount=1.0, max_len=4096)
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True,
                           sessions=[s.session_id for s in samples])
    mbs = micro_batches(samples, adv, pad_id=0, max_tokens=8192)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=setting.lr, weight_decay=0.0)
    model.train()
    if setting.ppo_epochs > 1:
        add_proximal_logprobs(model, mbs)
    for _ in range(setting.ppo_epochs):
        train_step(model, optimizer, mbs, PPOOptions(), rewards=[given[i] for i in train])
    model.eval()
    after = greedy_scores(model, tokenizer, held, subset)
    verdict = decide([Pair("t", a, b) for a, b in zip(after, before, strict=True)], {"t": max_regression})
    return {"serving": round(statistics.fmean(before), 4), "candidate": round(statistics.fmean(after), 4),
            "diff": round(verdict.overall.diff_mean, 4), "ci_low": round(verdict.overall.ci_low, 4),
            "ci_high": round(verdict.overall.ci_high, 4), "rejected": not verdict.passed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--only", default="", help="run only the settings whose name contains this text")
    ap.add_argument("--arms", default="negated,true", help="which rewards: negated, true or both (comma-separated)")
    ap.add_argument("--max-regression", type=float, default=0.05, help="the gate's tolerance (the gate test's tenant: 0)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = cached_tiny_model()
    report: dict[str, dict[str, list[dict[str, float | bool]]]] = {}
    for setting in (s for s in SETTINGS if args.only in s.name):
        report[setting.name] = {}
        for arm, negate in (("negated", True), ("true", False)):
            if arm not in args.arms.split(","):
                continue
            runs = [run(setting, base, seed, negate=negate, max_regression=args.max_regression) for seed in range(args.first_seed, args.first_seed + args.seeds)]
            report[setting.name][arm] = runs
            diffs = [r["diff"] for r in runs]
            lower = sum(r["candidate"] < r["serving"] for r in runs)
            print(f"{setting.name}, {arm} rewards: rejected {sum(bool(r['rejected']) for r in runs)}/{len(runs)}, "
                  f"candidate lower {lower}/{len(runs)}; "
                  f"held-out greedy score difference median {statistics.median(diffs):+.3f}, "
                  f"min {min(diffs):+.3f}, max {max(diffs):+.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
