"""FSDP2 training on the CPU: 2 ranks under torchrun (gloo), and the plain single-process path.

Toy task: for each prompt two sessions share a task id; the output full of token X gets reward 1,
the one without X gets -1. A few decoupled-PPO steps must raise the probability of the rewarded
outputs, lower the loss, and produce a checkpoint that reloads with transformers.

This file is also the torchrun worker: `python tests/integration/test_trainer_fsdp.py BASE OUT [--lora]`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import dist
from trainer.batch import Sample, StepTokens, build_samples, micro_batches, pack, split_for_ranks
from trainer.checkpoint import (
    gather_full_state_dict,
    load_optimizer_state,
    save_optimizer_state,
    write_checkpoint,
)
from trainer.loss import PPOOptions, group_advantages, token_logprobs, train_step
from trainer.model import LoraOptions, load_model, shard

X = 42  # the rewarded token
STEPS = 8
REPO = Path(__file__).resolve().parents[2]


def toy_samples(base_dir: Path) -> list[Sample]:
    """Six tasks x (good, bad) outputs, with behaviour logprobs from the base model (as the engine's)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    steps = []
    for task in range(6):
        prompt = torch.randint(3, 300, (4 + task,), generator=g).tolist()
        good = [X if i % 2 == 0 else 43 + i for i in range(6)]
        bad = torch.randint(100, 300, (6,), generator=g).tolist()
        for kind, output, reward in (("good", good, 1.0), ("bad", bad, -1.0)):
            steps.append(
                StepTokens(
                    step_id=f"{task}-{kind}",
                    session_id=f"{task}-{kind}",
                    task_id=f"task{task}",
                    seq=0,
                    prompt_ids=prompt,
                    output_ids=output,
                    behaviour_logprobs=[0.0] * len(output),
                    output_versions=["v0"] * len(output),
                    output_mask=[1] * len(output),
                    prompt_exact=True,
                    reward=reward,
                    version_lag=0,
                )
            )
    samples = build_samples(steps, mode="trajectory", turn_discount=1.0, max_len=64)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    for s in samples:
        ids = torch.tensor([s.input_ids])
        with torch.no_grad():
            logp = token_logprobs(base, ids, torch.ones_like(ids))[0]
        s.behaviour_logprobs = [lp if m else 0.0 for lp, m in zip(logp.tolist(), s.loss_mask, strict=True)]
    return samples


def mean_logp(model, samples: list[Sample], reward: float) -> float:
    """Mean per-token logprob of the outputs with this reward (every rank runs the same forward)."""
    chosen = [s for s in samples if s.reward == reward]
    b = pack(chosen, pad_id=0, advantages=[0.0] * len(chosen))
    model.eval()
    with torch.no_grad():
        logp = token_logprobs(model, b["input_ids"], b["attention_mask"], position_ids=b["position_ids"])
    model.train()
    return ((logp * b["loss_mask"]).sum() / b["loss_mask"].sum()).item()


def run_training(base_dir: Path, out_dir: Path, *, lora: bool = False) -> dict:
    """The trainer's core loop on the toy batch; the same code for 1 process or under torchrun."""
    rank, world = dist.init()
    torch.manual_seed(0)
    samples = dist.broadcast_object(toy_samples(base_dir) if rank == 0 else None)
    advantages = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    mine, my_adv = split_for_ranks(samples, advantages, rank=rank, world=world)
    mbs = micro_batches(mine, my_adv, pad_id=0, max_tokens=48)

    model = load_model(
        base_dir, dtype="fp32", grad_checkpointing=True, lora=LoraOptions(r=4, alpha=8) if lora else None
    )
    shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-3 if lora else 5e-4, weight_decay=0.0)
    opts = PPOOptions(ratio_mask_low=0.2, ratio_mask_high=5.0)

    before = {"good": mean_logp(model, samples, 1.0), "bad": mean_logp(model, samples, -1.0)}
    history = [
        train_step(model, optimizer, mbs, opts, rewards=[s.reward for s in samples]) for _ in range(STEPS)
    ]
    after = {"good": mean_logp(model, samples, 1.0), "bad": mean_logp(model, samples, -1.0)}

    state = gather_full_state_dict(model)
    result = {"world": world, "before": before, "after": after, "history": history, "micro_batches": len(mbs),
              "optimizer_state_equal": optimizer_round_trip(model, optimizer, out_dir)}
    if rank == 0:
        write_checkpoint(state, base_dir=base_dir, out_dir=out_dir, dtype="fp32")
        (out_dir.parent / f"{out_dir.name}.json").write_text(json.dumps(result))
    dist.barrier()
    return result


def optimizer_round_trip(model, optimizer, out_dir: Path) -> bool:
    """Save the (sharded) AdamW state, load it into a fresh optimizer: equal on every rank?"""
    path = out_dir.parent / f"{out_dir.name}-state" / "optimizer.pt"
    save_optimizer_state(model, optimizer, path, version=out_dir.name, checkpoint=str(out_dir))
    dist.barrier()  # rank 0 wrote it
    fresh = torch.optim.AdamW(optimizer.param_groups[0]["params"], lr=1.0)
    loaded = load_optimizer_state(model, fresh, path, version=out_dir.name, checkpoint=str(out_dir))
    equal = loaded and all(
        torch.equal(_local(fresh.state[p][k]), _local(v)) for p, st in optimizer.state.items() for k, v in st.items()
    )
    equal = equal and len(fresh.state) == len(optimizer.state) > 0
    return bool(dist.all_reduce(torch.tensor([float(equal)]), op="min").item())


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


def _check_learning(result: dict) -> None:
    first, last = result["history"][0], result["history"][-1]
    assert result["after"]["good"] > result["before"]["good"] + 0.1
    assert result["after"]["bad"] < result["before"]["bad"]
    assert last["loss"] < first["loss"]
    assert first["reward_mean"] == 0.0 and first["reward_std"] == pytest.approx(1.0)
    assert first["tokens"] == 12 * 6  # every output token trained at the first step
    assert first["tokens_per_s"] > 0
    assert result["optimizer_state_equal"]  # saved, reloaded into a fresh AdamW, equal on every rank


def _check_checkpoint(base_dir: Path, out_dir: Path, *, trained_model=None) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert not any(p.name.startswith(f".{out_dir.name}.tmp") for p in out_dir.parent.iterdir())
    names = {p.name for p in out_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    with safe_open(out_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        # tied: the head is written out too (vLLM's in-place reload re-prepares only layers it gets)
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    assert not any("lora" in k or "base_layer" in k for k in keys)

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(str(out_dir)).encode("the fox") == AutoTokenizer.from_pretrained(
        str(base_dir)
    ).encode("the fox")
    ids = torch.tensor([[5, 17, 99, X, 200, 3]])
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, new(ids).logits, atol=1e-3)
        if trained_model is not None:
            trained_model.eval()
            torch.testing.assert_close(new(ids).logits, trained_model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    from tests.trainer_tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "base", seed=0, tied=True)


def _torchrun(base_dir: Path, out_dir: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).resolve()), str(base_dir), str(out_dir), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out_dir.parent / f"{out_dir.name}.json").read_text())


def test_fsdp_two_ranks_learns_and_checkpoints(base_dir, tmp_path):
    result = _torchrun(base_dir, tmp_path / "v1")
    assert result["world"] == 2
    _check_learning(result)
    # step 0: the sharded trainer recomputes exactly the logprobs of the unsharded "engine" model
    assert result["history"][0]["mean_abs_logp_diff"] < 1e-4
    assert result["history"][0]["masked_frac"] == 0.0
    _check_checkpoint(base_dir, tmp_path / "v1")

    # the same run in one plain process (no process group) gives the same weights: the loss
    # normalisation does not depend on how the batch was split over ranks and micro-batches
    single = run_training(base_dir, tmp_path / "single")
    assert single["world"] == 1
    _check_learning(single)
    from safetensors.torch import load_file

    # gradient scale: the global gradient norm of the first step is the same
    assert result["history"][0]["grad_norm"] == pytest.approx(single["history"][0]["grad_norm"], rel=1e-4)
    two = load_file(tmp_path / "v1" / "model.safetensors")
    one = load_file(tmp_path / "single" / "model.safetensors")
    assert two.keys() == one.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=5e-5, rtol=1e-4, msg=k)


def test_fsdp_two_ranks_lora(base_dir, tmp_path):
    result = _torchrun(base_dir, tmp_path / "lora", "--lora")
    _check_learning(result)
    _check_checkpoint(base_dir, tmp_path / "lora")


def test_single_process_lora_merge_matches_trained_model(base_dir, tmp_path):
    model = load_model(base_dir, dtype="fp32", grad_checkpointing=False, lora=LoraOptions(r=4, alpha=8))
    samples = toy_samples(base_dir)
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mbs = micro_batches(samples, adv, pad_id=0, max_tokens=256)
    for _ in range(3):
        train_step(model, optimizer, mbs, PPOOptions())
    state = gather_full_state_dict(model)
    out = write_checkpoint(state, base_dir=base_dir, out_dir=tmp_path / "merged", dtype="fp32")
    _check_checkpoint(base_dir, out, trained_model=model)


def test_bf16_checkpoint_and_existing_dir(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = load_model(base_dir, dtype="bf16", grad_checkpointing=False)
    out = write_checkpoint(
        gather_full_state_dict(model), base_dir=base_dir, out_dir=tmp_path / "bf", dtype="bf16"
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert reloaded.dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 99]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model.eval()(ids).logits)
    with pytest.raises(FileExistsError):
        write_checkpoint(gather_full_state_dict(model), base_dir=base_dir, out_dir=out, dtype="bf16")


if __name__ == "__main__":  # torchrun worker
    try:
        run_training(Path(sys.argv[1]), Path(sys.argv[2]), lora="--lora" in sys.argv)
    finally:
        dist.close()
