"""The RL objective: group advantages, decoupled PPO-clip, train/engine disagreement masking.

Shapes: every per-token tensor is [B, T] and aligned to input_ids (position i is about token i, as
predicted from tokens < i; see batch.py).

Three policies appear in decoupled PPO (AReaL):
    behaviour  pi_b    the engine weights that sampled the tokens (logprobs captured from vLLM)
    proximal   pi_prox the "old" policy PPO keeps the update close to (defaults to pi_b)
    current    pi      the weights being trained

    loss_t = - (pi_prox / pi_b) * min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A),
    r_t = pi / pi_prox

Tokens where the trainer and the engine disagree too much are dropped from the loss (IcePop-style
ratio bounds, and/or a bound on the Bernoulli KL between the two token probabilities): those tokens
carry mostly numerical mismatch, not signal.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer import dist


def group_advantages(rewards: Sequence[float], groups: Sequence[str], *, normalize_std: bool) -> list[float]:
    """Advantage = reward - baseline.

    A sample whose group (task id) has >= 2 members in the batch uses its group's mean reward as the
    baseline (GRPO). Any other sample (group "" or a group of one) uses the leave-one-out mean of all
    *other* samples in the batch, so its own reward does not bias its baseline. A batch of one sample
    has no baseline (0).

    normalize_std: divide by the std of the rewards the baseline came from (group, or whole batch),
    plus a small epsilon so that a group of equal rewards gives 0 rather than NaN.
    """
    if len(rewards) != len(groups):
        raise ValueError("rewards and groups must have the same length")
    n = len(rewards)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        if g:
            members.setdefault(g, []).append(i)
    total = sum(rewards)
    batch_std = _std(rewards)

    advantages = []
    for i, r in enumerate(rewards):
        group = members.get(groups[i], [])
        if len(group) >= 2:
            group_rewards = [rewards[j] for j in group]
            baseline = sum(group_rewards) / len(group_rewards)
            std = _std(group_rewards)
        else:
            baseline = (total - r) / (n - 1) if n > 1 else 0.0  # leave-one-out batch mean
            std = batch_std
        a = r - baseline
        if normalize_std:
            a /= std + 1e-6
        advantages.append(a)
    return advantages


def _std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(input_ids[:, i] | input_ids[:, :i]) for every i, in fp32; column 0 is 0.

    vLLM reports logprobs of the raw model distribution by default, so keep temperature 1 unless
    the engine was asked for processed (temperature-scaled) logprobs.
    """
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    logits = out.logits[:, :-1].float()  # [B, T-1, V]; row i predicts token i+1
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    # log softmax at the target = target logit - logsumexp over the vocabulary
    logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return F.pad(logp, (1, 0))  # shift right: position 0 has no prediction


def bernoulli_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(Ber(p) || Ber(q)) from log-probabilities: how differently two models rate one token."""
    p = logp.exp()
    # log(1 - p) computed stably as log(-expm1(log p)); clamp keeps p == 1 finite.
    log1m_p = torch.log(-torch.expm1(logp.clamp(max=-1e-7)))
    log1m_q = torch.log(-torch.expm1(logq.clamp(max=-1e-7)))
    return p * (logp - logq) + (1 - p) * (log1m_p - log1m_q)


def ppo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    ratio_mask_low: float,
    ratio_mask_high: float,
    kl_mask: float | None,
    proximal_logp: torch.Tensor | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss with token-level disagreement masking.

    logp: current policy (with grad). behaviour_logp: the engine's. proximal_logp: the old policy;
    None means the behaviour policy plays that role (importance weight 1).
    The disagreement mask compares the trainer's view of the old policy (proximal_logp, or the
    current logp detached when none) with the engine's, so it flags numeric mismatch, not learning.
    num_tokens: the normaliser; None = the number of unmasked tokens here. Pass a global count when
    the batch is split across micro-batches or ranks.
    Returns (loss, stats); stats: loss, clip_frac, masked_frac, mean_abs_logp_diff, tokens, mask_tokens.
    """
    mask = loss_mask > 0
    prox = behaviour_logp if proximal_logp is None else proximal_logp
    # Trainer's log-probability of the old policy: what the engine's number should have been.
    trainer_old = (logp if proximal_logp is None else proximal_logp).detach()

    # --- token masking where trainer and engine disagree ---
    train_vs_engine = torch.exp(trainer_old - behaviour_logp)  # p_train / p_engine
    keep = mask & (train_vs_engine >= ratio_mask_low) & (train_vs_engine <= ratio_mask_high)
    if kl_mask is not None:
        keep &= bernoulli_kl(trainer_old, behaviour_logp) <= kl_mask
    keep_f = keep.float()

    # --- decoupled PPO-clip ---
    behave_weight = torch.exp(prox - behaviour_logp).detach()  # pi_prox / pi_b; 1 when prox is None
    ratio = torch.exp(logp - prox)  # r = pi / pi_prox
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)  # pessimistic bound
    per_token = -behave_weight * surrogate

    kept = keep_f.sum()
    denom = num_tokens if num_tokens is not None else kept.clamp(min=1.0)
    loss = (per_token * keep_f).sum() / denom

    with torch.no_grad():
        # Clipped = the clipped term is the one min() picked (its gradient is zero there).
        is_clipped = (clipped * advantages < ratio * advantages) & keep
        n_mask = mask.sum()
        stats = {
            "loss": loss.item(),
            "clip_frac": (is_clipped.sum() / kept.clamp(min=1)).item(),
            "masked_frac": ((n_mask - kept) / n_mask.clamp(min=1)).item(),
            # Trainer vs engine on the policy that sampled (before this update moved it).
            "mean_abs_logp_diff": (
                (trainer_old - behaviour_logp).abs()[mask].sum() / n_mask.clamp(min=1)
            ).item(),
            "tokens": kept.item(),
            "mask_tokens": n_mask.item(),
        }
    return loss, stats


@dataclass
class PPOOptions:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28  # "clip higher" leaves more room to raise unlikely good tokens
    ratio_mask_low: float = 0.5
    ratio_mask_high: float = 2.0
    kl_mask: float | None = None
    temperature: float = 1.0
    max_grad_norm: float | None = 1.0


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    opts: PPOOptions,
    *,
    rewards: Sequence[float] | None = None,
) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches (gradient accumulation), the same on every rank.

    The loss is normalised by the number of trainable tokens over all micro-batches of all ranks, so
    the update does not depend on how the batch was split. `rewards` (the whole batch) only feeds the
    logged reward mean/std.
    """
    if not micro_batches:
        raise ValueError("every rank needs at least one micro-batch (see batch.split_for_ranks)")
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    world = dist.world_size()

    # Global count of trainable tokens, and how many micro-batches the busiest rank has: every rank
    # must run as many forward/backward passes (FSDP collectives), extra ones with zero weight.
    local = torch.tensor(
        [sum(mb["loss_mask"].sum().item() for mb in micro_batches), len(micro_batches)], dtype=torch.float64
    )
    total_tokens = dist.all_reduce(local.clone(), op="sum")[0].item()
    n_passes = int(dist.all_reduce(local.clone(), op="max")[1].item())
    # FSDP averages gradients over ranks; scale so the sum over ranks is normalised by total_tokens.
    num_tokens = max(total_tokens, 1.0) / world

    model.train()
    sums = {"loss": 0.0, "clipped": 0.0, "masked": 0.0, "abs_diff": 0.0, "tokens": 0.0, "mask_tokens": 0.0}
    seen_tokens = 0.0
    for k in range(n_passes):
        mb = {key: v.to(device) for key, v in micro_batches[min(k, len(micro_batches) - 1)].items()}
        weight = 1.0 if k < len(micro_batches) else 0.0  # a padding pass contributes nothing
        logp = token_logprobs(
            model,
            mb["input_ids"],
            mb["attention_mask"],
            position_ids=mb["position_ids"],
            temperature=opts.temperature,
        )
        loss, st = ppo_loss(
            logp,
            mb["behaviour_logprobs"],
            mb["advantages"],
            mb["loss_mask"] * weight,
            clip_eps_low=opts.clip_eps_low,
            clip_eps_high=opts.clip_eps_high,
            ratio_mask_low=opts.ratio_mask_low,
            ratio_mask_high=opts.ratio_mask_high,
            kl_mask=opts.kl_mask,
            proximal_logp=mb.get("proximal_logprobs"),
            num_tokens=num_tokens,
        )
        loss.backward()
        if weight:
            # Undo the per-rank scaling so the logged loss is the global per-token mean.
            sums["loss"] += st["loss"] / world
            sums["clipped"] += st["clip_frac"] * st["tokens"]
            sums["masked"] += st["masked_frac"] * st["mask_tokens"]
            sums["abs_diff"] += st["mean_abs_logp_diff"] * st["mask_tokens"]
            sums["tokens"] += st["tokens"]
            sums["mask_tokens"] += st["mask_tokens"]
            seen_tokens += mb["attention_mask"].sum().item()

    grad_norm = float("nan")
    if opts.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], opts.max_grad_norm
        )
        grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    keys = ["loss", "clipped", "masked", "abs_diff", "tokens", "mask_tokens"]
    g = dist.all_reduce(torch.tensor([sums[k] for k in keys] + [seen_tokens], dtype=torch.float64), op="sum")
    total = dict(zip(keys + ["seen"], g.tolist(), strict=True))
    elapsed = time.perf_counter() - t0
    stats = {
        "loss": total["loss"],
        "clip_frac": total["clipped"] / max(total["tokens"], 1.0),
        "masked_frac": total["masked"] / max(total["mask_tokens"], 1.0),
        "mean_abs_logp_diff": total["abs_diff"] / max(total["mask_tokens"], 1.0),
        "tokens": total["tokens"],
        "tokens_per_s": total["seen"] / elapsed,
        "grad_norm": grad_norm,
        "step_s": elapsed,
    }
    if rewards:
        stats["reward_mean"] = sum(rewards) / len(rewards)
        stats["reward_std"] = _std(rewards)
    return stats


@torch.no_grad()
def add_proximal_logprobs(
    model: nn.Module, micro_batches: Sequence[dict[str, torch.Tensor]], *, temperature: float = 1.0
) -> None:
    """Stores the current policy's logprobs as `proximal_logprobs` in each micro-batch, before the
    first of several optimizer steps on the same batch (PPO epochs). All ranks must call it with the
    same number of micro-batches."""
    device = next(model.parameters()).device
    model.eval()
    for mb in micro_batches:
        logp = token_logprobs(
            model,
            mb["input_ids"].to(device),
            mb["attention_mask"].to(device),
            position_ids=mb["position_ids"].to(device),
            temperature=temperature,
        )
        mb["proximal_logprobs"] = logp.cpu() * mb["loss_mask"]
