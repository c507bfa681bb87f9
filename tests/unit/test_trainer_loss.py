"""The RL math on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer_tiny import build_tiny_llama
from trainer.loss import (
    PPOOptions,
    bernoulli_kl,
    group_advantages,
    k3_kl,
    ppo_loss,
    token_logprobs,
    train_step,
)

WIDE = {"ratio_mask_low": 0.0, "ratio_mask_high": math.inf, "kl_mask": None}
CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.28}


def t(*xs: float) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.float32)


def logs(*ps: float) -> torch.Tensor:
    return t(*(math.log(p) for p in ps))


# --- advantages ---


def test_group_mean_baseline_and_leave_one_out():
    rewards = [1.0, 0.0, 0.5, 2.0, 4.0, 3.0]
    groups = ["a", "a", "a", "", "", "lonely"]
    adv = group_advantages(rewards, groups, normalize_std=False)
    # group a: mean 0.5
    assert adv[:3] == pytest.approx([0.5, -0.5, 0.0])
    # ungrouped and single-member groups: mean of all the other samples of the batch
    assert adv[3] == pytest.approx(2.0 - (1 + 0 + 0.5 + 4 + 3) / 5)
    assert adv[4] == pytest.approx(4.0 - (1 + 0 + 0.5 + 2 + 3) / 5)
    assert adv[5] == pytest.approx(3.0 - (1 + 0 + 0.5 + 2 + 4) / 5)


def test_group_std_normalisation():
    adv = group_advantages([1.0, 0.0, 0.5], ["a", "a", "a"], normalize_std=True)
    std = math.sqrt(((0.5**2) * 2) / 3)  # population std of {1, 0, 0.5}
    assert adv == pytest.approx([0.5 / std, -0.5 / std, 0.0], rel=1e-4)
    # all equal: zero advantage, not NaN
    assert group_advantages([1.0, 1.0], ["b", "b"], normalize_std=True) == [0.0, 0.0]


def test_single_sample_has_no_baseline():
    assert group_advantages([0.7], [""], normalize_std=False) == [0.7]


def test_a_session_counts_once_in_its_group_however_many_samples():
    # group g: session a gave 3 samples (reward 1), session b one (reward 0). Per sample the
    # baseline would be 0.75; per session it is 0.5.
    rewards = [1.0, 1.0, 1.0, 0.0]
    adv = group_advantages(rewards, ["g"] * 4, normalize_std=False, sessions=["a", "a", "a", "b"])
    assert adv == pytest.approx([0.5, 0.5, 0.5, -0.5])
    # normalised by the per-session std (0.5), not the per-sample one (0.433)
    adv = group_advantages(rewards, ["g"] * 4, normalize_std=True, sessions=["a", "a", "a", "b"])
    assert adv == pytest.approx([1.0, 1.0, 1.0, -1.0], rel=1e-4)


def test_leave_one_out_leaves_out_the_whole_session():
    # ungrouped: x (2 samples, reward 1), y (0), z (0.5). x's baseline is the mean over y and z.
    adv = group_advantages([1.0, 1.0, 0.0, 0.5], [""] * 4, normalize_std=False, sessions=["x", "x", "y", "z"])
    assert adv[:2] == pytest.approx([0.75, 0.75])
    # y: mean over x (once) and z = (1 + 0.5) / 2
    assert adv[2] == pytest.approx(-0.75)
    # a group whose samples all come from one session has no group baseline
    adv = group_advantages([1.0, 0.0, 0.5], ["g", "g", ""], normalize_std=False, sessions=["x", "x", "y"])
    assert adv[:2] == pytest.approx([0.5, -0.5])  # baseline: session y's 0.5


# --- PPO clipping ---


def _loss_and_grad(logp_new, logp_behaviour, adv, **kw):
    logp = logp_new.clone().requires_grad_(True)
    mask = torch.ones_like(logp)
    loss, stats = ppo_loss(logp, logp_behaviour, adv * mask, mask, **{**CLIP, **WIDE, **kw})
    loss.backward()
    return loss.item(), logp.grad, stats


def test_positive_advantage_clipped_above():
    # ratio 0.6/0.4 = 1.5 > 1 + 0.28: the gain is capped, no gradient pushes further
    loss, grad, stats = _loss_and_grad(logs(0.6), logs(0.4), t(1.0))
    assert loss == pytest.approx(-1.28, rel=1e-5)
    assert grad.item() == 0.0
    assert stats["clip_frac"] == 1.0


def test_negative_advantage_not_clipped_above():
    # A < 0 and ratio 1.5: min(-1.5, -1.28) = -1.5, unclipped, gradient pushes logp down
    loss, grad, stats = _loss_and_grad(logs(0.6), logs(0.4), t(-1.0))
    assert loss == pytest.approx(1.5, rel=1e-5)
    assert grad.item() == pytest.approx(1.5, rel=1e-5)  # d(-r*A)/dlogp = -A*r
    assert stats["clip_frac"] == 0.0


def test_negative_advantage_clipped_below_and_positive_not():
    # ratio 0.5 < 1 - 0.2
    loss, grad, stats = _loss_and_grad(logs(0.2), logs(0.4), t(-1.0))
    assert loss == pytest.approx(0.8, rel=1e-5)
    assert grad.item() == 0.0 and stats["clip_frac"] == 1.0
    loss, grad, stats = _loss_and_grad(logs(0.2), logs(0.4), t(1.0))
    assert loss == pytest.approx(-0.5, rel=1e-5)
    assert grad.item() == pytest.approx(-0.5, rel=1e-5) and stats["clip_frac"] == 0.0


def test_loss_is_mean_over_unmasked_tokens():
    # two on-policy tokens (ratio 1) with advantages 1 and 3, one token outside the loss mask
    logp = logs(0.5, 0.5, 0.5)
    mask = t(1, 1, 0)
    loss, stats = ppo_loss(logp, logp, t(1.0, 3.0, 0.0), mask, **CLIP, **WIDE)
    assert loss.item() == pytest.approx(-2.0)
    assert stats["tokens"] == 2 and stats["masked_frac"] == 0.0
    # an explicit global normaliser replaces the local count
    loss, _ = ppo_loss(logp, logp, t(1.0, 3.0, 0.0), mask, **CLIP, **WIDE, num_tokens=8)
    assert loss.item() == pytest.approx(-0.5)


# --- disagreement masking ---


def test_ratio_mask_drops_tokens_outside_bounds():
    # train/engine ratios: 3.0 (too high), 0.2 (too low), 1.0 (kept), 1.5 (kept)
    logp = logs(0.6, 0.02, 0.3, 0.3)
    behaviour = logs(0.2, 0.1, 0.3, 0.2)
    adv = t(1.0, 1.0, 2.0, -1.0)
    mask = torch.ones_like(logp)
    loss, stats = ppo_loss(
        logp, behaviour, adv, mask, **CLIP, ratio_mask_low=0.5, ratio_mask_high=2.0, kl_mask=None
    )
    # kept: token 2 (r=1, A=2 -> -2) and token 3 (r=1.5, A=-1 -> +1.5); mean over 2 tokens
    assert loss.item() == pytest.approx((-2.0 + 1.5) / 2, rel=1e-5)
    assert stats["masked_frac"] == pytest.approx(0.5)
    assert stats["tokens"] == 2
    diffs = [abs(math.log(a / b)) for a, b in [(0.6, 0.2), (0.02, 0.1), (0.3, 0.3), (0.3, 0.2)]]
    assert stats["mean_abs_logp_diff"] == pytest.approx(sum(diffs) / 4, rel=1e-5)


def test_bernoulli_kl_value():
    kl = bernoulli_kl(logs(0.9), logs(0.5)).item()
    assert kl == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5), rel=1e-5)
    assert bernoulli_kl(logs(0.3), logs(0.3)).item() == pytest.approx(0.0, abs=1e-7)


def test_kl_mask_drops_confident_disagreement_only():
    # p 0.9 vs 0.5: ratio 1.8 passes the ratio bounds, KL 0.368 > 0.1 is masked;
    # p 0.015 vs 0.01: ratio 1.5, KL ~0.001, kept
    logp = logs(0.9, 0.015)
    behaviour = logs(0.5, 0.01)
    mask = torch.ones_like(logp)
    _, stats = ppo_loss(
        logp, behaviour, t(1.0, 1.0), mask, **CLIP, ratio_mask_low=0.5, ratio_mask_high=2.0, kl_mask=None
    )
    assert stats["masked_frac"] == 0.0
    loss, stats = ppo_loss(
        logp, behaviour, t(1.0, 1.0), mask, **CLIP, ratio_mask_low=0.5, ratio_mask_high=2.0, kl_mask=0.1
    )
    assert stats["masked_frac"] == pytest.approx(0.5)
    assert loss.item() == pytest.approx(-1.28, rel=1e-5)  # only token 2: ratio 1.5, clipped at 1.28


def test_masked_tokens_get_no_gradient():
    logp = logs(0.6, 0.3).requires_grad_(True)
    loss, _ = ppo_loss(
        logp,
        logs(0.1, 0.3),
        t(1.0, 1.0),
        torch.ones(1, 2),
        **CLIP,
        ratio_mask_low=0.5,
        ratio_mask_high=2.0,
        kl_mask=None,
    )
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # ratio 6: masked
    assert logp.grad[0, 1].item() == pytest.approx(-1.0)  # on-policy token, A=1, one token


def test_proximal_policy_decoupling():
    # behaviour 0.5, proximal 0.6, current 0.66: weight pi_prox/pi_b = 1.2, ratio pi/pi_prox = 1.1
    logp = logs(0.66).requires_grad_(True)
    loss, stats = ppo_loss(logp, logs(0.5), t(1.0), torch.ones(1, 1), **CLIP, **WIDE, proximal_logp=logs(0.6))
    assert loss.item() == pytest.approx(-1.2 * 1.1, rel=1e-5)
    assert stats["clip_frac"] == 0.0
    # current 0.9: ratio 1.5 is clipped against the proximal policy, not the behaviour one
    loss, stats = ppo_loss(
        logs(0.9), logs(0.5), t(1.0), torch.ones(1, 1), **CLIP, **WIDE, proximal_logp=logs(0.6)
    )
    assert loss.item() == pytest.approx(-1.2 * 1.28, rel=1e-5)
    assert stats["clip_frac"] == 1.0
    # the disagreement mask looks at proximal vs behaviour (1.2 here), not at the learning step
    _, stats = ppo_loss(
        logs(0.99),
        logs(0.5),
        t(1.0),
        torch.ones(1, 1),
        **CLIP,
        ratio_mask_low=0.5,
        ratio_mask_high=1.5,
        kl_mask=None,
        proximal_logp=logs(0.6),
    )
    assert stats["masked_frac"] == 0.0


def test_session_weights_make_the_loss_a_mean_over_sessions():
    # session 1: three on-policy tokens, A = 1 (weights 1/3 each); session 2: one token, A = 3
    logp = logs(0.5, 0.5, 0.5, 0.5)
    weights = t(1 / 3, 1 / 3, 1 / 3, 1.0)
    loss, stats = ppo_loss(logp, logp, t(1.0, 1.0, 1.0, 3.0), weights, **CLIP, **WIDE)
    assert loss.item() == pytest.approx(-(1.0 + 3.0) / 2)  # per token it would be -6 / 4
    assert stats["tokens"] == 4


# --- numerics: the engine's -inf (-9999) and other absurd logprobs ---


@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("masks", [WIDE, {"ratio_mask_low": 0.5, "ratio_mask_high": 2.0, "kl_mask": 0.1}])
@pytest.mark.parametrize("proximal", [False, True])
def test_impossible_behaviour_logprob_gives_finite_loss_and_grads(adv, masks, proximal):
    # vLLM reports -inf as -9999: exp(logp - behaviour) = exp(9999) = inf, and 0 * inf = NaN
    logp = logs(0.3, 0.5).requires_grad_(True)
    behaviour = t(-9999.0, math.log(0.5))
    prox = t(math.log(0.3), math.log(0.5)) if proximal else None
    mask = t(1.0, 1.0)
    loss, stats = ppo_loss(logp, behaviour, t(adv, adv), mask, **CLIP, **masks, proximal_logp=prox)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in stats.values())
    if masks is not WIDE:  # the ratio mask drops it; the other token trains as usual
        assert stats["masked_frac"] == 0.5
        assert logp.grad[0, 0].item() == 0.0
        assert logp.grad[0, 1].item() == pytest.approx(-adv)


def test_padding_with_garbage_logprobs_stays_out_of_the_gradient():
    # a masked position may hold anything (an inf behaviour logprob, a NaN-free but absurd logp)
    logp = t(math.log(0.5), -1e4).requires_grad_(True)
    behaviour = t(math.log(0.5), float("-inf"))
    loss, _ = ppo_loss(logp, behaviour, t(1.0, 1.0), t(1.0, 0.0), **CLIP, **WIDE)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad.tolist() == [[pytest.approx(-1.0), 0.0]]


@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_non_finite_behaviour_logprob_on_a_trained_token_is_dropped(bad):
    logp = logs(0.5, 0.5).requires_grad_(True)
    loss, stats = ppo_loss(logp, t(bad, math.log(0.5)), t(1.0, 1.0), t(1.0, 1.0), **CLIP, **WIDE)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and logp.grad.tolist() == [[0.0, pytest.approx(-1.0)]]
    assert stats["tokens"] == 1 and stats["mask_tokens"] == 1


def test_train_step_with_a_minus_9999_logprob_keeps_weights_finite(tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.batch import StepTokens, build_samples, micro_batches

    model = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "m"), dtype=torch.float32)
    steps = [
        StepTokens(step_id=f"s{k}", session_id=f"s{k}", task_id="t", seq=0, prompt_ids=[5, 6, 7],
                   output_ids=[8, 9, 10], behaviour_logprobs=[-9999.0, -5.0, -6.0], output_versions=["v"] * 3,
                   output_mask=[1, 1, 1], prompt_exact=True, reward=float(k), version_lag=0)
        for k in range(2)
    ]
    samples = build_samples(steps, mode="step", turn_discount=1.0, max_len=64)
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    mbs = micro_batches(samples, adv, pad_id=0, max_tokens=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for opts in (PPOOptions(), PPOOptions(ratio_mask_low=0.0, ratio_mask_high=math.inf, kl_coef=0.1)):
        stats = train_step(model, optimizer, mbs, opts)
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
        assert all(torch.isfinite(p).all() for p in model.parameters())


# --- redacted prompts: the on-policy fallback ---


def test_inexact_tokens_train_on_policy():
    # token 0: exact, on-policy (A = 1). token 1: its prompt was redacted, the engine's number
    # (0.01 vs the trainer's 0.5) is about another context: no mask, importance weight 1.
    logp = logs(0.5, 0.5).requires_grad_(True)
    behaviour = logs(0.5, 0.01)
    exact = t(1.0, 0.0)
    loss, stats = ppo_loss(
        logp, behaviour, t(1.0, 2.0), t(1.0, 1.0), **CLIP, ratio_mask_low=0.5, ratio_mask_high=2.0, kl_mask=0.1,
        exact=exact,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2)  # both ratios 1
    assert logp.grad.tolist() == [[pytest.approx(-0.5), pytest.approx(-1.0)]]  # the policy gradient
    assert stats["masked_frac"] == 0.0 and stats["exact_tokens"] == 1 and stats["onpolicy_tokens"] == 1
    assert stats["mean_abs_logp_diff"] == 0.0  # only exact tokens say how far trainer and engine are
    # without the flag the same token is a 50x disagreement and is dropped
    _, stats = ppo_loss(logp, behaviour, t(1.0, 2.0), t(1.0, 1.0), **CLIP, ratio_mask_low=0.5,
                        ratio_mask_high=2.0, kl_mask=None)
    assert stats["masked_frac"] == 0.5


def test_inexact_tokens_use_the_proximal_policy_with_ppo_epochs():
    # with a proximal policy the fallback is pi_b := pi_prox: weight 1, ratio pi / pi_prox, clipped
    logp = logs(0.9)
    _, stats = ppo_loss(logp, logs(0.01), t(1.0), t(1.0), **CLIP, **WIDE, proximal_logp=logs(0.6), exact=t(0.0))
    assert stats["loss"] == pytest.approx(-1.28, rel=1e-5)  # ratio 1.5 clipped, no 60x weight
    assert stats["clip_frac"] == 1.0


# --- KL penalty ---


def test_k3_kl_value_and_gradient():
    # r = pi_ref / pi = 0.25 / 0.5: k3 = r - log r - 1
    logp = logs(0.5).requires_grad_(True)
    ref = logs(0.25)
    kl = k3_kl(logp, ref, torch.ones(1, 1, dtype=torch.bool))
    assert kl.item() == pytest.approx(0.5 - math.log(0.5) - 1, rel=1e-5)
    kl.sum().backward()
    assert logp.grad.item() == pytest.approx(1 - 0.5, rel=1e-5)  # descent lowers logp towards the ref
    assert k3_kl(logs(0.3), logs(0.3), torch.ones(1, 1, dtype=torch.bool)).item() == pytest.approx(0.0, abs=1e-7)
    assert k3_kl(logs(0.3), t(-9999.0), torch.ones(1, 1, dtype=torch.bool)).isfinite().all()


def test_kl_penalty_is_added_per_token():
    # on-policy token (ratio 1), A = 0: the loss is the KL term alone
    logp = logs(0.5).requires_grad_(True)
    loss, stats = ppo_loss(logp, logs(0.5), t(0.0), t(1.0), **CLIP, **WIDE, kl_coef=0.2, ref_logp=logs(0.25))
    loss.backward()
    k3 = 0.5 - math.log(0.5) - 1
    assert loss.item() == pytest.approx(0.2 * k3, rel=1e-5) and stats["kl"] == pytest.approx(k3, rel=1e-5)
    assert logp.grad.item() == pytest.approx(0.2 * 0.5, rel=1e-5)
    # default reference: the behaviour policy; kl_coef 0 leaves the loss as it was (the KL is logged)
    loss, stats = ppo_loss(logs(0.5), logs(0.25), t(0.0), t(1.0), **CLIP, **WIDE, kl_coef=0.0)
    assert loss.item() == 0.0 and stats["kl"] == pytest.approx(k3, rel=1e-5)
    loss, _ = ppo_loss(logs(0.5), logs(0.25), t(0.0), t(1.0), **CLIP, **WIDE, kl_coef=1.0)
    assert loss.item() == pytest.approx(k3, rel=1e-5)


# --- logprobs from a real model ---


def test_token_logprobs_matches_manual_and_ignores_right_padding(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "m"), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 350, (1, 9), generator=g)
    with torch.no_grad():
        got = token_logprobs(model, ids, torch.ones_like(ids))
        logits = model(ids).logits.double()
    assert got.shape == ids.shape and got.dtype == torch.float32
    assert got[0, 0] == 0.0
    for i in range(1, ids.shape[1]):
        want = torch.log_softmax(logits[0, i - 1], -1)[ids[0, i]].item()
        assert got[0, i].item() == pytest.approx(want, abs=1e-5)

    # the same sequence right-padded next to a longer one: identical logprobs on its real tokens
    longer = torch.randint(3, 350, (1, 14), generator=g)
    batch = torch.zeros(2, 14, dtype=torch.long)
    batch[0, :9], batch[1] = ids[0], longer[0]
    attn = torch.zeros_like(batch)
    attn[0, :9], attn[1] = 1, 1
    pos = torch.arange(14).expand(2, 14)
    with torch.no_grad():
        padded = token_logprobs(model, batch, attn, position_ids=pos)
    torch.testing.assert_close(padded[0, :9], got[0], atol=1e-5, rtol=0)
