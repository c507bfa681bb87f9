"""Samples from captured token ids: per step vs trajectory, discount, redaction, staleness, packing."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from trainer.batch import (
    StepTokens,
    build_samples,
    group_key,
    micro_batches,
    pack,
    sample_counts,
    session_weights,
    split_for_ranks,
    split_stale,
)
from trainer.loss import group_advantages


def step(
    sid: str,
    seq: int,
    prompt: list[int],
    output: list[int],
    *,
    session: str = "s1",
    task: str | None = None,
    reward: float = 1.0,
    mask: list[int] | None = None,
    lag: int = 0,
    exact: bool = True,
) -> StepTokens:
    return StepTokens(
        step_id=sid,
        session_id=session,
        task_id=task,
        seq=seq,
        prompt_ids=prompt,
        output_ids=output,
        behaviour_logprobs=[-0.1 * (i + 1) for i in range(len(output))],
        output_versions=["v1"] * len(output),
        output_mask=mask if mask is not None else [1] * len(output),
        prompt_exact=exact,
        reward=reward,
        version_lag=lag,
    )


def chained_session(session: str = "s1", reward: float = 1.0, task: str | None = None) -> list[StepTokens]:
    """Three turns; each prompt = previous prompt + output + new tokens (a tool result, a user turn)."""
    s0 = step(f"{session}-0", 0, [10, 11, 12], [20, 21], session=session, reward=reward, task=task)
    s1 = step(f"{session}-1", 1, [10, 11, 12, 20, 21, 13], [22], session=session, reward=reward, task=task)
    s2 = step(
        f"{session}-2",
        2,
        [10, 11, 12, 20, 21, 13, 22, 14, 15],
        [23, 24, 25],
        session=session,
        reward=reward,
        task=task,
    )
    return [s0, s1, s2]


def test_per_step_samples_with_turn_discount():
    samples = build_samples(chained_session(reward=2.0), mode="step", turn_discount=0.5, max_len=100)
    assert [s.reward for s in samples] == [0.5, 1.0, 2.0]  # 2 * 0.5**(T-1-t)
    first = samples[0]
    assert first.input_ids == [10, 11, 12, 20, 21]
    assert first.loss_mask == [0, 0, 0, 1, 1]
    assert first.behaviour_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2])
    assert first.step_ids == ["s1-0"]


def test_trajectory_sample_when_prompts_extend_token_for_token():
    steps = chained_session(reward=2.0)
    samples = build_samples(list(reversed(steps)), mode="trajectory", turn_discount=1.0, max_len=100)
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids == [10, 11, 12, 20, 21, 13, 22, 14, 15, 23, 24, 25]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert s.behaviour_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, -0.1, 0, 0, -0.1, -0.2, -0.3])
    assert s.reward == 2.0  # the session's reward on every turn's tokens
    assert s.step_ids == ["s1-0", "s1-1", "s1-2"]
    # every turn's tokens sit where the per-step sample has them, after the same context
    for st in steps:
        (alone,) = build_samples([st], mode="step", turn_discount=1.0, max_len=100)
        n = len(alone.input_ids)
        assert s.input_ids[:n] == alone.input_ids
        assert s.loss_mask[len(st.prompt_ids):n] == alone.loss_mask[len(st.prompt_ids):]
    with pytest.raises(ValueError, match="turn_discount"):
        build_samples(steps, mode="trajectory", turn_discount=0.5, max_len=100)
    with pytest.raises(ValueError, match="sample mode"):
        build_samples(steps, mode="concat", turn_discount=1.0, max_len=100)


def test_broken_chain_falls_back_per_step_where_it_breaks():
    s0, s1, s2 = chained_session()
    # turn 2's prompt was rebuilt differently (e.g. context compaction): no longer a token prefix
    s2.prompt_ids = [10, 99, 13, 22, 14]
    traj = build_samples([s0, s1, s2], mode="trajectory", turn_discount=1.0, max_len=100)
    assert [s.step_ids for s in traj] == [["s1-0", "s1-1"], ["s1-2"]]
    assert traj[1].input_ids == [10, 99, 13, 22, 14, 23, 24, 25]
    assert sample_counts([s0, s1, s2], traj) == {"trajectory_samples": 1, "trajectory_steps": 2, "single_steps": 1,
                                                 "prefix_breaks": 1}
    per_step = build_samples([s0, s1, s2], mode="step", turn_discount=0.5, max_len=100)
    assert [s.reward for s in per_step] == [0.25, 0.5, 1.0]
    assert sample_counts([s0, s1, s2], per_step) == {"trajectory_samples": 0, "trajectory_steps": 0,
                                                     "single_steps": 3, "prefix_breaks": 1}


def test_steps_with_different_rewards_do_not_share_a_sequence():
    s0, s1, s2 = chained_session()
    s0.reward = -1.0  # a step-level reward for turn 0 only
    traj = build_samples([s0, s1, s2], mode="trajectory", turn_discount=1.0, max_len=100)
    assert [(s.step_ids, s.reward) for s in traj] == [(["s1-0"], -1.0), (["s1-1", "s1-2"], 1.0)]


def test_trajectory_cut_at_max_len_trains_what_step_samples_train():
    steps = chained_session()
    for max_len in (4, 6, 7, 9, 11, 12):
        (traj,) = build_samples(steps, mode="trajectory", turn_discount=1.0, max_len=max_len)
        per_step = build_samples(steps, mode="step", turn_discount=1.0, max_len=max_len)
        assert traj.step_ids == [i for s in per_step for i in s.step_ids]  # a turn cut off entirely is left out
        assert sum(traj.loss_mask) == sum(sum(s.loss_mask) for s in per_step)
        assert len(traj.input_ids) <= max_len


def test_advantages_agree_between_modes_and_a_session_counts_once():
    # A 3-turn session (reward 1), a 1-turn session (reward 0) and a broken 2-turn one (reward 0.5).
    b0, b1, _ = chained_session("b", reward=0.5)
    b1.prompt_ids = [10, 99]  # breaks the chain: two samples in trajectory mode too
    steps = chained_session("a", reward=1.0) + [step("o", 0, [1, 2], [3], session="o", reward=0.0), b0, b1]
    by_mode = {}
    for mode in ("step", "trajectory"):
        samples = build_samples(steps, mode=mode, turn_discount=1.0, max_len=100)
        adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True,
                               sessions=[s.session_id for s in samples], sizes=[len(s.step_ids) for s in samples])
        by_mode[mode] = {i: a for s, a in zip(samples, adv, strict=True) for i in s.step_ids}
        packed = pack(samples, pad_id=0, normalize_std=True)  # pack's own advantages weigh samples the same way
        per_token = {i: a for s, row in zip(samples, packed["advantages"], strict=True)
                     for i, a in zip(s.step_ids, [row[s.loss_mask.index(1)].item()] * len(s.step_ids), strict=True)}
        assert per_token == pytest.approx(by_mode[mode], abs=1e-6)
    assert by_mode["step"] == pytest.approx(by_mode["trajectory"])
    # leave-one-out over sessions, each once: a's baseline is the mean of o and b, (0 + 0.5) / 2
    std = statistics.pstdev([1.0, 0.0, 0.5])
    assert by_mode["step"]["a-0"] == pytest.approx((1.0 - 0.25) / (std + 1e-6), rel=1e-5)


def test_redacted_output_tokens_are_not_trained():
    s = step("a", 0, [5, 6], [7, 8, 9], mask=[1, 0, 1], exact=False)
    (sample,) = build_samples([s], mode="step", turn_discount=1.0, max_len=100)
    # the re-derived prompt is still context; the redacted output token stays in place, untrained
    assert sample.input_ids == [5, 6, 7, 8, 9]
    assert sample.loss_mask == [0, 0, 1, 0, 1]
    assert sample.behaviour_logprobs == pytest.approx([0, 0, -0.1, 0, -0.3])


def test_missing_engine_logprob_is_not_trained():
    s = step("a", 0, [5, 6], [7, 8])
    s.behaviour_logprobs = [math.nan, -0.5]
    (sample,) = build_samples([s], mode="step", turn_discount=1.0, max_len=100)
    assert sample.loss_mask == [0, 0, 0, 1]
    assert sample.behaviour_logprobs == [0, 0, 0, -0.5]


def test_fully_masked_step_makes_no_sample():
    s = step("a", 0, [5, 6], [7, 8], mask=[0, 0])
    assert build_samples([s], mode="step", turn_discount=1.0, max_len=100) == []


def test_groups_only_when_several_sessions_share_a_task():
    steps = (
        chained_session("x", task="t1") + chained_session("y", task="t1") + chained_session("z", task="t2")
    )
    steps += [step("n", 0, [1, 2], [3], session="n", task=None)]
    samples = build_samples(steps, mode="trajectory", turn_discount=1.0, max_len=100)
    by_step = {s.step_ids[-1]: s.group for s in samples}
    assert by_step == {"x-2": group_key("", "t1"), "y-2": group_key("", "t1"), "z-2": "", "n": ""}


def test_groups_are_scoped_to_the_tenant():
    # Tenants A and B both call a task "t1": they are different tasks, with different baselines.
    steps = []
    for session, tenant in (("a1", "A"), ("a2", "A"), ("b1", "B")):
        steps += [step(session, 0, [1, 2], [3], session=session, task="t1")]
        steps[-1].tenant_id = tenant
    samples = build_samples(steps, mode="step", turn_discount=1.0, max_len=100)
    by_session = {s.session_id: s.group for s in samples}
    assert by_session == {"a1": group_key("A", "t1"), "a2": group_key("A", "t1"), "b1": ""}
    # no tenant can name a task so that it collides with another tenant's
    assert group_key("A", "x") != group_key("A\\", "x") and group_key("a:b", "c") != group_key("a", "b:c")


def test_redacted_prompt_tokens_are_marked_for_the_on_policy_fallback():
    s0, s1, s2 = chained_session()
    s1.prompt_exact = False  # its prompt ids were rewritten by redaction
    (sample,) = build_samples([s0, s1, s2], mode="trajectory", turn_discount=1.0, max_len=100)
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert sample.exact == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]  # turn 1 stays trainable, not exact
    per_step = build_samples([s0, s1, s2], mode="step", turn_discount=1.0, max_len=100)
    assert [s.exact[len(st.prompt_ids):] for s, st in zip(per_step, (s0, s1, s2), strict=True)] == [
        [1, 1], [0], [1, 1, 1]
    ]
    batch = pack([sample], pad_id=0, advantages=[1.0])
    assert batch["exact"].tolist() == [[float(x) for x in sample.exact]]


def test_session_weighting_counts_each_session_once():
    # session s1: 3 per-step samples with 2 + 1 + 3 trained tokens; session o: 1 sample, 1 token
    steps = chained_session("s1") + [step("o", 0, [1, 2], [3], session="o")]
    samples = build_samples(steps, mode="step", turn_discount=1.0, max_len=100)
    tokens = session_weights(samples, "token")
    assert [s.weight for s in tokens] == [1.0, 1.0, 1.0, 1.0]
    weighted = session_weights(samples, "session")
    assert {s.session_id: s.weight for s in weighted} == {"s1": pytest.approx(1 / 6), "o": 1.0}
    batch = pack(weighted, pad_id=0, advantages=[0.0] * 4)
    # every session's tokens sum to 1: the loss normaliser is the number of sessions
    assert batch["token_weights"].sum().item() == pytest.approx(2.0)
    assert pack(tokens, pad_id=0, advantages=[0.0] * 4)["token_weights"].sum().item() == 7.0
    with pytest.raises(ValueError):
        session_weights(samples, "steps")


def test_truncation_keeps_the_left_and_drops_empty_samples():
    s = step("a", 0, [1, 2, 3], [4, 5, 6])
    (sample,) = build_samples([s], mode="step", turn_discount=1.0, max_len=4)
    assert sample.input_ids == [1, 2, 3, 4]
    assert sample.loss_mask == [0, 0, 0, 1]
    assert sample.behaviour_logprobs == pytest.approx([0, 0, 0, -0.1])
    assert build_samples([s], mode="step", turn_discount=1.0, max_len=3) == []


def test_first_token_is_never_trainable():
    s = step("a", 0, [], [4, 5])
    (sample,) = build_samples([s], mode="step", turn_discount=1.0, max_len=10)
    assert sample.loss_mask == [0, 1]


def test_stale_steps_are_split_off_and_stay_as_context_in_a_trajectory():
    s0, s1, s2 = chained_session()
    s1.version_lag = 5
    fresh, stale = split_stale([s0, s1, s2], max_version_lag=2)
    assert [s.step_id for s in stale] == ["s1-1"]
    (sample,) = build_samples(fresh, mode="trajectory", turn_discount=1.0, max_len=100)
    assert sample.step_ids == ["s1-0", "s1-2"]
    # turn 1's output token (22) is in the sequence but not trained
    assert sample.input_ids[6] == 22 and sample.loss_mask[6] == 0
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]


def test_inconsistent_step_is_rejected():
    s = step("a", 0, [1], [2, 3])
    s.output_versions = ["v1"]
    with pytest.raises(ValueError):
        build_samples([s], mode="step", turn_discount=1.0, max_len=10)


def test_pack_pads_right_and_spreads_advantages():
    a = build_samples(
        [step("a", 0, [1, 2], [3, 4], session="a", reward=1.0)], mode="step", turn_discount=1, max_len=50
    )
    b = build_samples(
        [step("b", 0, [1], [5], session="b", reward=0.0)], mode="step", turn_discount=1, max_len=50
    )
    batch = pack(a + b, pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [1, 5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    # leave-one-out baselines: 1 - 0 and 0 - 1
    assert batch["advantages"].tolist() == [[0, 0, 1, 1], [0, -1, 0, 0]]
    torch.testing.assert_close(
        batch["behaviour_logprobs"], torch.tensor([[0, 0, -0.1, -0.2], [0, -0.1, 0, 0]])
    )
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3]
    assert batch["rewards"].tolist() == [1.0, 0.0]


def test_split_for_ranks_and_micro_batches():
    samples = []
    for i in range(5):
        samples += build_samples(
            [step(f"s{i}", 0, [1] * (i + 2), [7, 8], session=f"s{i}", reward=float(i))],
            mode="step",
            turn_discount=1,
            max_len=50,
        )
    adv = [float(i) for i in range(5)]
    parts = [split_for_ranks(samples, adv, rank=r, world=2) for r in range(2)]
    ids = sorted(s.step_ids[0] for part, _ in parts for s in part)
    assert ids == ["s0", "s1", "s2", "s3", "s4"]  # every sample exactly once
    assert {len(parts[0][0]), len(parts[1][0])} == {2, 3}
    for part, part_adv in parts:  # advantages travel with their samples
        assert [float(s.step_ids[0][1:]) for s in part] == part_adv

    # more ranks than samples: the extra rank gets a sample with nothing to train
    extra, extra_adv = split_for_ranks(samples[:1], adv[:1], rank=1, world=2)
    assert len(extra) == 1 and sum(extra[0].loss_mask) == 0 and extra_adv == [0.0]

    mbs = micro_batches(samples, adv, pad_id=0, max_tokens=14)
    assert all(mb["input_ids"].numel() <= 14 or mb["input_ids"].shape[0] == 1 for mb in mbs)
    assert sum(mb["input_ids"].shape[0] for mb in mbs) == 5
    # each sample's advantage lands on its 2 trainable tokens, in whichever micro-batch it went to
    assert sum(mb["advantages"].sum().item() for mb in mbs) == pytest.approx(2 * sum(adv))
