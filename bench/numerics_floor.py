"""How exact can a rounding emulation be? The bf16 noise floor of a model, without an engine.

trainer/numerics.py reproduces where a bf16 engine rounds; it cannot reproduce the order in which the
engine's GEMM kernels add up their fp32 partial sums (oneDNN, torch or vLLM's own kernels, blocked
differently for a decode step's one row than for the trainer's whole sequence). This bench measures
what that order alone costs: the same emulated forward (one profile, same weights, same tokens) with
every linear layer's fp32 accumulation done in another order, each variant against the emulation:

    permuted-k    the K inputs of every linear layer permuted (a fixed random order): the same sum,
                  added in another order, then rounded to bf16 as before
    fp64          accumulated in fp64, then rounded to bf16 (the exactly rounded result)
    torch-bf16    torch's own bf16 GEMM (oneDNN where the CPU has bf16 dot products), output bf16

Rounding points are not changed, so any gap here is what no rounding profile can remove: a floor for
|trainer logprob - engine logprob| on this model. The tokens are the trained-looking version's own
answers (temperature 1, seeded) to the bench's questions; nothing here talks to vLLM.

`--steps FILE` (`bench/logprob_match.py --save-steps`) uses an engine's answers instead and also
reports each variant against the engine's behaviour logprobs: a variant that fits the engine better
than the emulation points at the GEMM the engine runs.

  python bench/numerics_floor.py [--model tiny|smollm2] [--profile bf16|bf16-amx|bf16-trunc] [--prompts tuning|heldout]
                                 [--weights trained-looking|base] [--steps FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.logprob_match import HELDOUT, QUESTIONS, cpu  # noqa: E402
from proxy.demo.model_zoo import cached_smollm2, cached_tiny_model  # noqa: E402
from trainer import numerics  # noqa: E402
from trainer.loss import token_logprobs  # noqa: E402

Linear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]


def _bf16_inputs(m: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    bias = None if m.bias is None else numerics.round_bf16(m.bias)
    return numerics.round_bf16(x), numerics.round_bf16(m.weight), bias


def permuted_k(seed: int) -> Linear:
    perms: dict[int, torch.Tensor] = {}

    def forward(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        x, w, b = _bf16_inputs(m, x)
        k = w.shape[1]
        if k not in perms:
            perms[k] = torch.randperm(k, generator=torch.Generator().manual_seed(seed + k))
        p = perms[k]
        return numerics.round_bf16(F.linear(x[..., p], w[:, p], b))

    return forward


def fp64(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    x, w, b = _bf16_inputs(m, x)
    out = F.linear(x.double(), w.double(), None if b is None else b.double())
    return numerics.round_bf16(out.float())


def torch_bf16(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    b = None if m.bias is None else m.bias.bfloat16()
    return F.linear(x.bfloat16(), m.weight.bfloat16(), b).float()


VARIANTS: dict[str, Linear | None] = {"emulation": None, "permuted-k": permuted_k(0), "fp64": fp64,
                                      "torch-bf16": torch_bf16}


def load(checkpoint: Path, profile: numerics.Profile, linear: Linear | None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = numerics.emulate(AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32), profile)
    if linear is not None:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.forward = linear.__get__(m)
    return model.eval()


def answers(checkpoint: Path, questions: list[str], n: int, max_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt + answer ids, prompt length): the fp32 model's own answers at temperature 1, seeded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    rows = []
    for i in range(n):
        prompt = tok.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        torch.manual_seed(i)
        out = model.generate(prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=tok.pad_token_id)
        rows.append((out, prompt.shape[1]))
    return rows


def engine_answers(path: Path) -> tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]:
    steps = json.loads(path.read_text())
    rows = [(torch.tensor([s["prompt_ids"] + s["output_ids"]]), len(s["prompt_ids"])) for s in steps]
    return rows, [torch.tensor(s["behaviour_logprobs"]) for s in steps]


def logprobs(model: nn.Module, rows: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [token_logprobs(model, ids, torch.ones_like(ids))[0, n:] for ids, n in rows]


def stats(values: list[float]) -> dict:
    s = sorted(values)
    return {"median": round(statistics.median(s), 4), "p90": round(s[int(0.9 * len(s))], 4), "max": round(s[-1], 4),
            "exact_frac": round(sum(v == 0 for v in s) / len(s), 3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    p.add_argument("--profile", default="bf16", choices=["bf16", "bf16-amx", "bf16-trunc"])
    p.add_argument("--prompts", default="heldout", choices=["tuning", "heldout"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--weights", default="trained-looking", choices=["trained-looking", "base"])
    p.add_argument("--steps", help="an engine's answers (bench/logprob_match.py --save-steps) to measure on")
    p.add_argument("--out")
    args = p.parse_args()
    from tests.vllm_fixtures import trained_looking_checkpoint
    from trainer.checkpoint import gather_full_state_dict, write_checkpoint
    from trainer.model import load_model

    base = cached_tiny_model(seed=0) if args.model == "tiny" else cached_smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        if args.weights == "trained-looking":  # the same bytes as bench/logprob_match.py serves
            fresh = trained_looking_checkpoint(base, Path(tmp) / "fresh")
        else:
            fresh = write_checkpoint(gather_full_state_dict(load_model(base, dtype="fp32", grad_checkpointing=False)),
                                     base_dir=base, out_dir=Path(tmp) / "fresh", dtype="fp32")
        engine = None
        if args.steps:
            rows, engine = engine_answers(Path(args.steps))
        else:
            rows = answers(fresh, HELDOUT if args.prompts == "heldout" else QUESTIONS, args.requests, args.max_tokens)
        ref = logprobs(load(fresh, args.profile, None), rows)
        result = {"model": args.model, "weights": args.weights, "profile": args.profile,
                  "answers": args.steps or f"own, {args.prompts}", "cpu": cpu(),
                  "tokens": sum(len(r) for r in ref), "torch_threads": torch.get_num_threads()}
        for name, linear in VARIANTS.items():
            got = logprobs(load(fresh, args.profile, linear), rows)
            result[name] = stats([v for a, b in zip(ref, got, strict=True) for v in (a - b).abs().tolist()])
            if engine is not None:
                result[name]["vs_engine"] = stats([v for a, b in zip(engine, got, strict=True)
                                                   for v in (a - b).abs().tolist()])
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
