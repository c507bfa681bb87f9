"""Trajectory samples against per-step samples, on steps stored in PostgreSQL (tiny trainer model).

A session whose prompts extend each other token for token trains as ONE sequence; every turn's
output tokens then see exactly the context a per-step sample gives them, so the two modes must
agree token for token: the same logprobs (hence log-ratios), the same loss and the same update, up
to float rounding. `atdp train --samples trajectory` runs the real loop on the same rows, and its
loss and checkpoint must equal the per-step computation.

The sessions come through the real proxy from the scripted upstream: the tiny random model on a
real engine rarely round-trips its own text to the same token ids, so it cannot be made to give
prefix-exact sessions, which is the case under test (a deliberately edited history gives the
broken one).
"""

from __future__ import annotations

import copy
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file

from proxy.governance.policies import Policies
from tests.integration.test_trainer_loop import _cfg, _feedback, _proxy
from trainer import lease
from trainer.batch import StepTokens, build_samples, micro_batches, session_weights
from trainer.loop import run
from trainer.loss import PPOOptions, group_advantages, token_logprobs, train_step
from trainer.model import load_model

LR = 1e-3
OPTS = PPOOptions(ratio_mask_low=0.0, ratio_mask_high=float("inf"))  # the scripted logprobs are made up


def _chat(proxy, sid: str, turns: list[str], *, edit_turn: int | None = None) -> None:
    """A multi-turn chat; with edit_turn, the client rewrites that answer before sending it back
    (a compacted or edited history), so the next prompt no longer extends the previous step."""
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    headers = {"x-atdp-session-id": sid, "x-atdp-task-id": "greet"}
    messages = []
    for k, text in enumerate(turns):
        messages.append({"role": "user", "content": f"#say {text}"})
        r = c.chat.completions.create(model="fake", messages=messages, extra_headers=headers, logprobs=True)
        answer = r.choices[0].message.content
        messages.append({"role": "assistant", "content": "(edited)" if k == edit_turn else answer})


def _load_steps(factory) -> list[StepTokens]:
    with factory() as s, s.begin():
        ids = lease.lease(s, owner="probe", ttl_s=60, max_steps=100)
        steps = lease.load(s, ids, current="base", policies=Policies()).steps
        lease.release(s, ids, owner="probe")
    return steps


def _batches(steps: list[StepTokens], mode: str):
    samples = session_weights(build_samples(steps, mode=mode, turn_discount=1.0, max_len=4096), "token")
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True,
                           sessions=[s.session_id for s in samples], sizes=[len(s.step_ids) for s in samples])
    return samples, micro_batches(samples, adv, pad_id=0, max_tokens=8192)


def _token_logprobs(model, steps: list[StepTokens], mode: str) -> dict[tuple[str, int], float]:
    """(step id, output index) -> the model's logprob of that output token, as the mode lays it out."""
    samples, _ = _batches(steps, mode)
    by_id = {st.step_id: st for st in steps}
    out = {}
    with torch.no_grad():
        for smp in samples:
            ids = torch.tensor([smp.input_ids])
            logp = token_logprobs(model, ids, torch.ones_like(ids))[0].tolist()
            for sid in smp.step_ids:
                start = len(by_id[sid].prompt_ids)  # a step's output follows its own prompt, in both modes
                for j in range(len(by_id[sid].output_ids)):
                    if smp.loss_mask[start + j]:
                        out[(sid, j)] = logp[start + j]
    return out


def _update(base, steps: list[StepTokens], mode: str):
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    samples, mbs = _batches(steps, mode)
    stats = train_step(model, optimizer, mbs, OPTS, rewards=[s.reward for s in samples])
    return stats, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trajectory_samples_train_exactly_like_step_samples(start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    for k in range(4):
        _chat(proxy, f"s{k}", ["first", "second", "third"])
        _feedback(proxy, f"s{k}", reward=k / 3)
    _chat(proxy, "edited", ["first", "second", "third"], edit_turn=0)
    _feedback(proxy, "edited", reward=0.5)
    proxy.flush()

    steps = _load_steps(factory)
    assert len(steps) == 15
    traj, _ = _batches(steps, "trajectory")
    per_step, _ = _batches(steps, "step")
    assert len(per_step) == 15
    # 4 prefix-exact sessions as one sequence each; the edited one breaks after its first turn
    assert sorted(len(s.step_ids) for s in traj) == [1, 2, 3, 3, 3, 3]
    assert sum(len(s.input_ids) for s in traj) < sum(len(s.input_ids) for s in per_step)

    base = load_model(tiny_dir, dtype="fp32", grad_checkpointing=False).eval()
    lp_traj, lp_step = _token_logprobs(base, steps, "trajectory"), _token_logprobs(base, steps, "step")
    assert lp_traj.keys() == lp_step.keys() and len(lp_traj) == sum(len(st.output_ids) for st in steps)
    behaviour = {(st.step_id, j): lp for st in steps for j, lp in enumerate(st.behaviour_logprobs)}
    worst = max(abs((lp_traj[k] - behaviour[k]) - (lp_step[k] - behaviour[k])) for k in lp_traj)
    assert worst < 1e-4, f"log-ratios differ by up to {worst}"

    stats_traj, weights_traj = _update(base, steps, "trajectory")
    stats_step, weights_step = _update(base, steps, "step")
    assert stats_traj["tokens"] == stats_step["tokens"] == len(lp_traj)
    assert stats_traj["loss"] == pytest.approx(stats_step["loss"], rel=1e-4, abs=1e-6)
    assert stats_traj["grad_norm"] == pytest.approx(stats_step["grad_norm"], rel=1e-4)
    for name, w in weights_step.items():
        torch.testing.assert_close(weights_traj[name], w, atol=1e-6, rtol=1e-5, msg=name)

    # The real loop on the same rows, in trajectory mode: the same loss and the same weights.
    (result,) = run(_cfg(url, proxy, tmp_path, samples="trajectory"))
    m = result.metrics
    assert result.status == "serving"
    assert m["sample_mode"] == "trajectory" and m["samples"] == 6 and m["steps"] == 15
    assert (m["trajectory_samples"], m["trajectory_steps"], m["single_steps"], m["prefix_breaks"]) == (5, 14, 1, 1)
    assert m["loss"] == pytest.approx(stats_step["loss"], rel=1e-4, abs=1e-6)
    saved = load_file(Path(m["checkpoint"]) / "model.safetensors")
    for name, w in saved.items():
        torch.testing.assert_close(w, weights_step[name], atol=1e-6, rtol=1e-5, msg=name)
