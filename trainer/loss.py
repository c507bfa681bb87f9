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

Every log-ratio is masked and clamped to +-LOG_RATIO_CLAMP before exp(): vLLM reports an impossible
token as -9999, and exp(9999) = inf would turn into NaN through 0 * inf even on a masked token.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer import dist
from trainer.sampling import processed_logprobs

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: far outside any ratio mask or clip, still finite in fp32


def safe_exp_ratio(log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) where `valid`, 1 elsewhere; never inf or NaN, whatever the inputs hold.

    torch.where, not multiplication by a 0/1 mask: 0 * inf is NaN, and so is its gradient.
    The clamp stops the gradient of a token whose ratio is absurd (it is masked or clipped anyway).
    """
    log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[str],
    *,
    normalize_std: bool,
    sessions: Sequence[str] | None = None,
    sizes: Sequence[int] | None = None,
) -> list[float]:
    """Advantage = reward - baseline, where every *session* counts once.

    A multi-turn session can give several samples (step mode, or a broken trajectory); counted per
    sample, a 10-turn session would weigh 10x in its group's mean and std. So each sample gets the
    weight size / (steps of its session), size being the steps it holds (1 per step sample, k for a
    trajectory of k steps), and every statistic below is a weighted one: with equal rewards inside
    a session this is exactly the mean over sessions, and a session's steps weigh the same whether
    they are trained one sample per step or as one sequence (batch.build_samples' modes agree).

    A sample whose group (batch.group_key: tenant and task) has >= 2 sessions in the batch uses its
    group's mean reward as the baseline (GRPO). Any other sample (group "" or a group of one
    session) uses the mean over all *other sessions* of the batch, so its own session's reward
    does not bias its baseline. A batch of one session has no baseline (0).

    normalize_std: divide by the std of the rewards the baseline came from (group, or whole batch),
    plus a small epsilon so that a group of equal rewards gives 0 rather than NaN.
    sessions: the session of each sample; None = every sample is its own session.
    sizes: the steps each sample holds; None = 1 each.
    """
    if len(rewards) != len(groups):
        raise ValueError("rewards and groups must have the same length")
    sessions = list(sessions) if sessions is not None else [str(i) for i in range(len(rewards))]
    if len(sessions) != len(rewards):
        raise ValueError("rewards and sessions must have the same length")
    sizes = list(sizes) if sizes is not None else [1] * len(rewards)
    per_session: dict[str, int] = defaultdict(int)
    for sid, n in zip(sessions, sizes, strict=True):
        per_session[sid] += n
    weight = [n / per_session[sid] for sid, n in zip(sessions, sizes, strict=True)]  # each session sums to 1

    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        if g:
            members[g].append(i)
    everyone = range(len(rewards))
    batch_std = _std([rewards[j] for j in everyone], [weight[j] for j in everyone])

    advantages = []
    for i, r in enumerate(rewards):
        group = members.get(groups[i], [])
        if len({sessions[j] for j in group}) >= 2:
            baseline = _mean([rewards[j] for j in group], [weight[j] for j in group])
            std = _std([rewards[j] for j in group], [weight[j] for j in group])
        else:
            # leave-one-out: the weighted mean over the other sessions of the batch
            others = [j for j in everyone if sessions[j] != sessions[i]]
            baseline = _mean([rewards[j] for j in others], [weight[j] for j in others]) if others else 0.0
            std = batch_std
        a = r - baseline
        if normalize_std:
            a /= std + 1e-6
        advantages.append(a)
    return advantages


def _mean(xs: Sequence[float], weights: Sequence[float]) -> float:
    return sum(w * x for x, w in zip(xs, weights, strict=True)) / sum(weights)


def _std(xs: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Population std, weighted when `weights` are given."""
    if len(xs) < 2:
        return 0.0
    weights = [1.0] * len(xs) if weights is None else weights
    mean = _mean(xs, weights)
    return math.sqrt(_mean([(x - mean) ** 2 for x in xs], weights))


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    sampling: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """log p(input_ids[:, i] | input_ids[:, :i]) for every i, in fp32; column 0 is 0.

    `sampling` (batch.pack's temperature / top_p / top_k, [B, T]): each token's logprob under the
    processed distribution it was sampled from (trainer/sampling.py), as vLLM reports it with
    `--logprobs-mode processed_logprobs`. `temperature` scales every row (an engine-wide setting).
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
    if sampling is not None:
        # Only tokens sampled other than plainly need the sort; row i predicts token i + 1.
        temp, top_p, top_k = (sampling[k][:, 1:].to(logits.device) for k in ("temperature", "top_p", "top_k"))
        rows = (temp != 1.0) | (top_p < 1.0) | (top_k > 0)
        if rows.any():
            processed = processed_logprobs(logits[rows], targets.squeeze(-1)[rows], temp[rows], top_p[rows], top_k[rows])
            logp = logp.masked_scatter(rows, processed)
    return F.pad(logp, (1, 0))  # shift right: position 0 has no prediction


def bernoulli_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(Ber(p) || Ber(q)) from log-probabilities: how differently two models rate one token."""
    p = logp.exp()
    # log(1 - p) computed stably as log(-expm1(log p)); clamp keeps p == 1 finite.
    log1m_p = torch.log(-torch.expm1(logp.clamp(max=-1e-7)))
    log1m_q = torch.log(-torch.expm1(logq.clamp(max=-1e-7)))
    return p * (logp - logq) + (1 - p) * (log1m_p - log1m_q)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref), Schulman's k3 estimator on tokens sampled from pi:

        k3 = r - log r - 1,   r = pi_ref / pi

    >= 0 for every token (unlike log(pi / pi_ref)), unbiased, low variance; its gradient
    1 - pi_ref / pi pulls logp towards the reference. 0 where not `valid`.
    """
    log_r = torch.where(valid, ref_logp - logp, torch.zeros_like(logp)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_r) - log_r - 1


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
    exact: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss with token-level disagreement masking.

    logp: current policy (with grad). behaviour_logp: the engine's. proximal_logp: the old policy;
    None means the behaviour policy plays that role (importance weight 1).
    loss_mask: > 0 on trained tokens, and that token's weight in the loss (1, or 1 / its session's
    token count with per-session weighting; see batch.session_weights).
    The disagreement mask compares the trainer's view of the old policy (proximal_logp, or the
    current logp detached when none) with the engine's, so it flags numeric mismatch, not learning.
    exact: 1 where behaviour_logp was computed on exactly these context ids, 0 on tokens of a step
    whose prompt was rewritten by redaction: those use the on-policy fallback (below).
    kl_coef, ref_logp: add kl_coef * k3(pi || pi_ref) per token; ref_logp None = behaviour policy.
    num_tokens: the normaliser; None = the summed weight of the kept tokens here. Pass a global
    total when the batch is split across micro-batches or ranks.
    Returns (loss, stats); stats: loss, clip_frac, masked_frac, mean_abs_logp_diff, kl, tokens,
    mask_tokens, exact_tokens, onpolicy_tokens.
    """
    weight = loss_mask.float()
    # A token without a finite engine logprob has no importance weight: it is not trained (batch.py
    # already drops them; -inf - -inf would be NaN below).
    mask = (weight > 0) & torch.isfinite(behaviour_logp)
    behaviour_logp = torch.where(mask, behaviour_logp, torch.zeros_like(behaviour_logp))
    # Trainer's log-probability of the old policy: what the engine's number should have been.
    trainer_old = (logp if proximal_logp is None else proximal_logp).detach()

    # --- on-policy fallback for redacted prompts ---
    # The engine scored these tokens after another prompt (the original, not the redacted one we
    # hold), so its logprob is not pi_b of this context. Take pi_b := the trainer's own detached
    # logprob: importance weight 1, nothing to disagree with, a plain policy-gradient token.
    on_policy = mask & (exact <= 0) if exact is not None else torch.zeros_like(mask)
    behaviour_logp = torch.where(on_policy, trainer_old, behaviour_logp)
    prox = behaviour_logp if proximal_logp is None else proximal_logp

    # --- token masking where trainer and engine disagree ---
    train_vs_engine = safe_exp_ratio(trainer_old - behaviour_logp, mask)  # p_train / p_engine
    keep = mask & (train_vs_engine >= ratio_mask_low) & (train_vs_engine <= ratio_mask_high)
    if kl_mask is not None:
        keep &= bernoulli_kl(trainer_old, behaviour_logp) <= kl_mask

    # --- decoupled PPO-clip ---
    behave_weight = safe_exp_ratio(prox - behaviour_logp, keep).detach()  # pi_prox / pi_b; 1 when prox is None
    ratio = safe_exp_ratio(logp - prox, keep)  # r = pi / pi_prox
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)  # pessimistic bound
    per_token = -behave_weight * surrogate

    # --- optional KL penalty to a reference policy ---
    kl = k3_kl(logp, behaviour_logp if ref_logp is None else ref_logp, keep)
    if kl_coef:
        per_token = per_token + kl_coef * kl

    w = torch.where(keep, weight, torch.zeros_like(weight))  # dropped tokens weigh 0 (no 0 * inf)
    kept_w = w.sum()
    denom = num_tokens if num_tokens is not None else torch.where(kept_w > 0, kept_w, torch.ones_like(kept_w))
    loss = (per_token * w).sum() / denom

    with torch.no_grad():
        # Clipped = the clipped term is the one min() picked (its gradient is zero there).
        is_clipped = (clipped * advantages < ratio * advantages) & keep
        kept = keep.sum()
        n_mask = mask.sum()
        exact_mask = mask & ~on_policy
        stats = {
            "loss": loss.item(),
            "clip_frac": (is_clipped.sum() / kept.clamp(min=1)).item(),
            "masked_frac": ((n_mask - kept) / n_mask.clamp(min=1)).item(),
            # Trainer vs engine on the policy that sampled (before this update moved it); only
            # tokens with a real engine logprob count.
            "mean_abs_logp_diff": (
                (trainer_old - behaviour_logp).abs()[exact_mask].sum() / exact_mask.sum().clamp(min=1)
            ).item(),
            "kl": (kl[keep].sum() / kept.clamp(min=1)).item(),
            "tokens": kept.item(),
            "mask_tokens": n_mask.item(),
            "exact_tokens": exact_mask.sum().item(),
            "onpolicy_tokens": on_policy.sum().item(),
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
    # KL penalty kl_coef * k3(pi || pi_ref); 0 = off. kl_ref: "behaviour" (the engine's logprobs:
    # the versions that sampled), "base" (the root of the serving version's lineage) or a checkpoint.
    kl_coef: float = 0.0
    kl_ref: str = "behaviour"


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
    # The token weights (batch.session_weights) sum to the token count, or to the session count.
    local = torch.tensor(
        [sum(_weights(mb).sum().item() for mb in micro_batches), len(micro_batches)], dtype=torch.float64
    )
    total_weight = dist.all_reduce(local.clone(), op="sum")[0].item()
    n_passes = int(dist.all_reduce(local.clone(), op="max")[1].item())
    # FSDP averages gradients over ranks; scale so the sum over ranks is normalised by total_weight.
    num_tokens = (total_weight if total_weight > 0 else 1.0) / world

    model.train()
    keys = ["loss", "clipped", "masked", "abs_diff", "kl", "tokens", "mask_tokens", "exact_tokens", "onpolicy_tokens"]
    sums = dict.fromkeys(keys, 0.0)
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
            sampling=mb if "top_p" in mb else None,
        )
        loss, st = ppo_loss(
            logp,
            mb["behaviour_logprobs"],
            mb["advantages"],
            _weights(mb) * weight,
            clip_eps_low=opts.clip_eps_low,
            clip_eps_high=opts.clip_eps_high,
            ratio_mask_low=opts.ratio_mask_low,
            ratio_mask_high=opts.ratio_mask_high,
            kl_mask=opts.kl_mask,
            proximal_logp=mb.get("proximal_logprobs"),
            num_tokens=num_tokens,
            exact=mb.get("exact"),
            kl_coef=opts.kl_coef,
            ref_logp=mb.get("ref_logprobs"),
        )
        loss.backward()
        if weight:
            # Undo the per-rank scaling so the logged loss is the global per-token mean.
            sums["loss"] += st["loss"] / world
            sums["clipped"] += st["clip_frac"] * st["tokens"]
            sums["masked"] += st["masked_frac"] * st["mask_tokens"]
            sums["abs_diff"] += st["mean_abs_logp_diff"] * st["exact_tokens"]
            sums["kl"] += st["kl"] * st["tokens"]
            for k in ("tokens", "mask_tokens", "exact_tokens", "onpolicy_tokens"):
                sums[k] += st[k]
            seen_tokens += mb["attention_mask"].sum().item()

    grad_norm = float("nan")
    if opts.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], opts.max_grad_norm
        )
        grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    g = dist.all_reduce(torch.tensor([sums[k] for k in keys] + [seen_tokens], dtype=torch.float64), op="sum")
    total = dict(zip(keys + ["seen"], g.tolist(), strict=True))
    elapsed = time.perf_counter() - t0
    stats = {
        "loss": total["loss"],
        "clip_frac": total["clipped"] / max(total["tokens"], 1.0),
        "masked_frac": total["masked"] / max(total["mask_tokens"], 1.0),
        "mean_abs_logp_diff": total["abs_diff"] / max(total["exact_tokens"], 1.0),
        "kl": total["kl"] / max(total["tokens"], 1.0),
        "tokens": total["tokens"],
        "exact_tokens": total["exact_tokens"],  # ratio against the engine's logprob
        "onpolicy_tokens": total["onpolicy_tokens"],  # redacted prompt: on-policy fallback
        "tokens_per_s": total["seen"] / elapsed,
        "grad_norm": grad_norm,
        "step_s": elapsed,
    }
    if rewards:
        stats["reward_mean"] = sum(rewards) / len(rewards)
        stats["reward_std"] = _std(rewards)
    return stats


def _weights(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token loss weights of a micro-batch (batch.pack); the 0/1 loss mask when it has none."""
    return mb["token_weights"] if "token_weights" in mb else mb["loss_mask"]


@torch.no_grad()
def add_proximal_logprobs(
    model: nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    temperature: float = 1.0,
    key: str = "proximal_logprobs",
) -> None:
    """Stores the model's logprobs as `key` in each micro-batch: the current policy before the
    first of several optimizer steps on the same batch (PPO epochs), or a frozen reference policy
    for the KL penalty (key="ref_logprobs"). All ranks must call it with the same number of
    micro-batches."""
    device = next(model.parameters()).device
    model.eval()
    for mb in micro_batches:
        logp = token_logprobs(
            model,
            mb["input_ids"].to(device),
            mb["attention_mask"].to(device),
            position_ids=mb["position_ids"].to(device),
            temperature=temperature,
            sampling=mb if "top_p" in mb else None,
        )
        mb[key] = logp.cpu() * mb["loss_mask"]
