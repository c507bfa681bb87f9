"""Training samples from the token ids the engine produced (never re-tokenized).

A captured step is a prompt (token ids the engine saw) and an output (token ids it sampled, each with
the engine's logprob and weight version). A `Sample` is one training sequence:

    input_ids            prompt tokens ... output tokens ... (more turns in trajectory mode)
    loss_mask            0 ............. 1 1 1 1 (0 where redacted or stale)
    behaviour_logprobs   0 ............. engine logprob of that token, aligned to input_ids
    exact                0 ............. 1 1 1 1 (0: the step's prompt was redacted, see below)

Conventions used everywhere in the trainer: position i of every per-token list or tensor is about
token input_ids[i], predicted from input_ids[:i]. Position 0 is never trainable.

Truncation (`max_len`): a sample longer than `max_len` is cut on the *right*. The kept output tokens
still see exactly the context the engine saw, so their behaviour logprobs stay valid; cutting on the
left would change every logprob. A sample with no trainable token left (prompt alone >= max_len) is
dropped.

Redacted prompts: a `rederived` step's ids were rewritten after the engine scored them, so the
engine's logprob is pi_b(y | original prompt) while the trainer sees the redacted prompt. Its output
tokens stay trainable but are marked `exact` 0, and the loss trains them on-policy (loss.ppo_loss).

Weighting (`session_weights`): per token (every trained token weighs 1, so long sessions weigh
more) or per session (every session's tokens share a total weight of 1, however many steps and
tokens it has).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from trainer.sampling import PLAIN, Sampling

Mode = Literal["step", "trajectory"]  # one sample per step, or per session (exact prefixes)


@dataclass
class StepTokens:
    """One captured LLM call, as the lease layer hands it to the trainer."""

    step_id: str
    session_id: str
    task_id: str | None
    seq: int  # order of the step inside its session
    prompt_ids: list[int]
    output_ids: list[int]
    behaviour_logprobs: list[float]  # one per output token, from the engine
    output_versions: list[str]  # weight version that produced each output token
    output_mask: list[int]  # 1 = trainable; 0 = masked by redaction
    prompt_exact: bool  # False: prompt tokens were re-derived (redaction); usable as context only
    reward: float  # the session's reward as seen by this step
    version_lag: int  # how many weight versions behind the current one this step's oldest token is
    tenant_id: str = ""  # advantage groups are (tenant, task): task ids are the tenant's own names
    sampling: Sampling = PLAIN  # the distribution its output tokens were sampled from (trainer/sampling.py)


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]  # aligned to input_ids; 0 where loss_mask is 0
    exact: list[int]  # aligned to input_ids; 1 where the behaviour logprob fits this context
    reward: float
    group: str  # group_key(tenant, task) when >= 2 sessions of the batch share it, else "" (batch baseline)
    step_ids: list[str]
    session_id: str = ""
    weight: float = 1.0  # loss weight of each of its trained tokens (session_weights)
    # Per token, aligned to input_ids: the sampling that drew it; None: all plain (raw distribution).
    sampling: list[Sampling] | None = None


def group_key(tenant_id: str, task_id: str) -> str:
    """The advantage group of a task: tenants name their tasks independently, so "t1" of tenant A
    and "t1" of tenant B are different tasks and must not share a baseline."""
    return json.dumps([tenant_id, task_id])


def split_stale(
    steps: Sequence[StepTokens], *, max_version_lag: int
) -> tuple[list[StepTokens], list[StepTokens]]:
    """(fresh, stale): steps more than `max_version_lag` versions old are not trained on.

    The caller marks the stale ones in the store. Passing only the fresh steps to `build_samples`
    still works in trajectory mode: a dropped turn's tokens stay in the sequence as context.
    """
    fresh = [s for s in steps if s.version_lag <= max_version_lag]
    stale = [s for s in steps if s.version_lag > max_version_lag]
    return fresh, stale


def extends(prev: StepTokens, step: StepTokens) -> bool:
    """True when `step`'s prompt starts with prev's prompt + output, token for token."""
    head = prev.prompt_ids + prev.output_ids
    return len(step.prompt_ids) >= len(head) and step.prompt_ids[: len(head)] == head


def _check(step: StepTokens) -> None:
    n = len(step.output_ids)
    if not (len(step.behaviour_logprobs) == len(step.output_versions) == len(step.output_mask) == n):
        raise ValueError(f"step {step.step_id}: per-output-token lists must all have {n} entries")


def _output_targets(step: StepTokens) -> tuple[list[int], list[float]]:
    """Loss mask and behaviour logprobs for a step's output tokens."""
    mask = []
    for keep, lp in zip(step.output_mask, step.behaviour_logprobs, strict=True):
        # A missing/invalid engine logprob makes the token untrainable: no importance weight.
        mask.append(1 if keep and math.isfinite(lp) else 0)
    logps = [lp if m else 0.0 for m, lp in zip(mask, step.behaviour_logprobs, strict=True)]
    return mask, logps


def _per_step_sample(step: StepTokens, reward: float) -> Sample:
    mask, logps = _output_targets(step)
    n_prompt = len(step.prompt_ids)
    return Sample(
        input_ids=step.prompt_ids + step.output_ids,
        loss_mask=[0] * n_prompt + mask,
        behaviour_logprobs=[0.0] * n_prompt + logps,
        exact=[0] * n_prompt + [int(step.prompt_exact)] * len(mask),
        reward=reward,
        group="",
        step_ids=[step.step_id],
        session_id=step.session_id,
        sampling=None if step.sampling.plain else [PLAIN] * n_prompt + [step.sampling] * len(step.output_ids),
    )


def _trajectory_sample(chain: list[StepTokens], reward: float) -> Sample:
    """One sequence for a chain where each prompt extends the previous prompt + output.

    The last step's prompt + output holds every earlier turn at the positions it had when the engine
    sampled it: step k's output sits right after its own prompt, so input_ids[:start_k] is exactly
    the context step k's tokens were sampled in, and their logprobs equal a per-step forward's.

        input_ids   p0 p0 o0 o0 u1 o1 u2 u2 o2 o2      (p: prompt, u: a turn's new prompt tokens,
        loss_mask    0  0  1  1  0  1  0  0  1  1       o: output: trained with its own behaviour
        behaviour    0  0 b0 b0  0 b1  0  0 b2 b2       logprobs b, versions and sampling)
    """
    last = chain[-1]
    input_ids = last.prompt_ids + last.output_ids
    loss_mask = [0] * len(input_ids)
    logps = [0.0] * len(input_ids)
    exact = [0] * len(input_ids)
    sampling = None if all(s.sampling.plain for s in chain) else [PLAIN] * len(input_ids)
    for step in chain:
        start = len(step.prompt_ids)
        mask, lps = _output_targets(step)
        loss_mask[start : start + len(mask)] = mask
        logps[start : start + len(lps)] = lps
        exact[start : start + len(mask)] = [int(step.prompt_exact)] * len(mask)
        if sampling is not None:
            sampling[start : start + len(mask)] = [step.sampling] * len(mask)
    return Sample(input_ids, loss_mask, logps, exact, reward, "", [s.step_id for s in chain], last.session_id,
                  sampling=sampling)


def _chains(steps: list[StepTokens]) -> list[list[StepTokens]]:
    """Maximal runs of consecutive steps that may share one sequence: each one's prompt extends the
    previous prompt + output token for token, and both have the same reward (one advantage for all
    of a sequence's tokens; a step-level reward that differs starts a new sequence)."""
    chains = [[steps[0]]]
    for step in steps[1:]:
        prev = chains[-1][-1]
        if extends(prev, step) and step.reward == prev.reward:
            chains[-1].append(step)
        else:
            chains.append([step])
    return chains


def _trainable_within(step: StepTokens, max_len: int) -> bool:
    """Whether any of the step's output tokens is trainable at a position below max_len (what a
    per-step sample cut at max_len would keep). Position 0 never is."""
    mask, _ = _output_targets(step)
    start = len(step.prompt_ids)
    return any(m and 0 < start + j < max_len for j, m in enumerate(mask))


def _truncate(sample: Sample, max_len: int) -> Sample | None:
    if len(sample.input_ids) > max_len:
        sample = replace(
            sample,
            input_ids=sample.input_ids[:max_len],
            loss_mask=sample.loss_mask[:max_len],
            behaviour_logprobs=sample.behaviour_logprobs[:max_len],
            exact=sample.exact[:max_len],
            sampling=sample.sampling[:max_len] if sample.sampling is not None else None,
        )
    # Position 0 has no context to be predicted from.
    sample.loss_mask[0] = 0
    sample.behaviour_logprobs[0] = 0.0
    return sample if any(sample.loss_mask) else None


def build_samples(
    steps: Sequence[StepTokens],
    *,
    mode: Mode,
    turn_discount: float,
    max_len: int,
) -> list[Sample]:
    """Turn captured steps into training samples.

    step: one sample per step; turn t of a T-step session gets reward * discount**(T-1-t), so the
      final turn gets the full session reward and earlier turns less.
    trajectory: one sample per maximal chain of steps that extend each other token for token and
      share a reward (a session that never breaks the chain becomes ONE sequence); every turn's
      output tokens are trained, with the session's reward, in the context they were sampled in.
      A step whose prompt does not extend its predecessor's prompt + output (the client edited or
      compacted its history, a re-rendered tool call) starts a new sequence: a session of such
      steps falls back to one sample per step. Needs turn_discount 1 (one reward per sequence).
      Cut at max_len like the last step's per-step sample would be; a turn left with no trainable
      token within max_len is left out of the sample (its tokens stay as context), as step mode
      would drop its sample.

    Both modes train the same tokens with the same advantages (loss.group_advantages weighs a
    sample by its steps) and the same context, hence the same loss up to float rounding.

    Steps of a session should all be passed together (T counts the steps given). The group of a
    sample is group_key(tenant, task) when at least two sessions in `steps` share that tenant's
    task, else "".
    """
    if mode not in ("step", "trajectory"):
        raise ValueError(f"unknown sample mode {mode!r} (step | trajectory)")
    if mode == "trajectory" and turn_discount != 1.0:
        raise ValueError("trajectory samples give every turn the session's reward: turn_discount must be 1")
    by_session: dict[str, list[StepTokens]] = defaultdict(list)
    for step in steps:
        _check(step)
        by_session[step.session_id].append(step)

    # Which (tenant, task) pairs are shared by several sessions: only those get a group baseline.
    sessions_per_task: dict[str, set[str]] = defaultdict(set)
    for step in steps:
        if step.task_id is not None:
            sessions_per_task[group_key(step.tenant_id, step.task_id)].add(step.session_id)

    samples: list[Sample] = []
    for session_steps in by_session.values():
        session_steps.sort(key=lambda s: s.seq)
        n_turns = len(session_steps)
        if mode == "step":
            # The last turn gets the full reward, each earlier turn one more discount.
            built = [_per_step_sample(s, s.reward * turn_discount ** (n_turns - 1 - t))
                     for t, s in enumerate(session_steps)]
        else:
            built = []
            for chain in _chains(session_steps):
                kept = [s for s in chain if _trainable_within(s, max_len)]
                if kept:
                    built.append(_trajectory_sample(kept, kept[-1].reward))

        first = session_steps[0]
        key = group_key(first.tenant_id, first.task_id) if first.task_id is not None else ""
        group = key if key and len(sessions_per_task[key]) >= 2 else ""
        for sample in built:
            sample.group = group
            kept_sample = _truncate(sample, max_len)
            if kept_sample is not None:
                samples.append(kept_sample)
    return samples


def sample_counts(steps: Sequence[StepTokens], samples: Sequence[Sample]) -> dict[str, int]:
    """How the trained steps were laid out, for the update's metrics:

    trajectory_steps    steps trained inside a sequence shared with other steps of their session
    single_steps        steps trained as a sequence of their own (step mode: all of them)
    prefix_breaks       consecutive steps of a session whose prompt does not extend the previous
                        prompt + output token for token: where trajectory mode has to start anew
    """
    in_samples = [len(s.step_ids) for s in samples]
    by_session: dict[str, list[StepTokens]] = defaultdict(list)
    for step in steps:
        by_session[step.session_id].append(step)
    breaks = 0
    for session_steps in by_session.values():
        ordered = sorted(session_steps, key=lambda s: s.seq)
        breaks += sum(not extends(a, b) for a, b in zip(ordered, ordered[1:], strict=False))
    return {"trajectory_samples": sum(1 for n in in_samples if n > 1),
            "trajectory_steps": sum(n for n in in_samples if n > 1),
            "single_steps": sum(1 for n in in_samples if n == 1), "prefix_breaks": breaks}


def session_weights(samples: Sequence[Sample], weighting: Literal["token", "session"]) -> list[Sample]:
    """Sets each sample's per-token loss weight over the whole batch (before split_for_ranks).

    token:   every trained token weighs 1; the loss is the mean over tokens (DAPO-style), so a
             session weighs as many tokens as it trained.
    session: a session's trained tokens share a total weight of 1 (each weighs 1 / its session's
             trained tokens in the batch); the loss is the mean over sessions of each session's
             mean token loss, so a 10-turn session counts once, like a 1-turn one.
    """
    if weighting == "token":
        return [replace(s, weight=1.0) for s in samples]
    if weighting != "session":
        raise ValueError(f"unknown weighting {weighting!r}")
    tokens: dict[str, int] = defaultdict(int)
    for s in samples:
        tokens[s.session_id] += sum(1 for m in s.loss_mask if m)
    return [replace(s, weight=1.0 / max(tokens[s.session_id], 1)) for s in samples]


def split_for_ranks(
    samples: Sequence[Sample], advantages: Sequence[float], *, rank: int, world: int
) -> tuple[list[Sample], list[float]]:
    """This rank's share of the batch, balanced by length (longest first, round-robin).

    Every rank gets at least one sample so that all ranks run the same collectives; a rank left
    without one gets a copy of the first sample with its loss mask zeroed (no gradient).
    """
    if not samples:
        raise ValueError("empty batch")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    mine = order[rank::world]
    if not mine:
        s = samples[order[0]]
        blank = replace(s, loss_mask=[0] * len(s.loss_mask), behaviour_logprobs=[0.0] * len(s.loss_mask),
                        exact=[0] * len(s.loss_mask))
        return [blank], [0.0]
    return [samples[i] for i in mine], [advantages[i] for i in mine]


def pack(
    samples: Sequence[Sample],
    pad_id: int,
    advantages: Sequence[float] | None = None,
    *,
    normalize_std: bool = False,
) -> dict[str, torch.Tensor]:
    """Right-padded tensors for one forward pass.

    `advantages` (one per sample) should come from the whole batch across ranks; when None they are
    computed from these samples alone with `loss.group_advantages`. Keys (all [B, T] unless noted):
    input_ids, attention_mask, position_ids, loss_mask (float), behaviour_logprobs (fp32),
    exact (float, 1 where the behaviour logprob fits the context), token_weights (loss_mask times
    the sample's weight), advantages (fp32, the sample's advantage on each trainable token, 0
    elsewhere), rewards ([B]); when a sample was not sampled plainly: temperature, top_p (fp32) and
    top_k (long), the sampling of each token (trainer/sampling.py).
    """
    if advantages is None:
        from trainer.loss import group_advantages

        advantages = group_advantages(
            [s.reward for s in samples], [s.group for s in samples], normalize_std=normalize_std,
            sessions=[s.session_id or s.step_ids[0] for s in samples], sizes=[len(s.step_ids) for s in samples],
        )
    width = max(len(s.input_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    behaviour = torch.zeros((n, width), dtype=torch.float32)
    exact = torch.zeros((n, width), dtype=torch.float32)
    weights = torch.zeros((n, width), dtype=torch.float32)
    adv = torch.zeros((n, width), dtype=torch.float32)
    for i, (s, a) in enumerate(zip(samples, advantages, strict=True)):
        t = len(s.input_ids)
        input_ids[i, :t] = torch.tensor(s.input_ids)
        attention_mask[i, :t] = 1
        loss_mask[i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behaviour[i, :t] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        exact[i, :t] = torch.tensor(s.exact, dtype=torch.float32)
        weights[i, :t] = s.weight * loss_mask[i, :t]
        adv[i, :t] = a * loss_mask[i, :t]
    # Right padding: real tokens sit at positions 0..t-1; padding positions are never attended to.
    position_ids = torch.arange(width).expand(n, width).clone()
    processed = {}
    if any(s.sampling is not None for s in samples):
        temperature = torch.ones((n, width), dtype=torch.float32)
        top_p = torch.ones((n, width), dtype=torch.float32)
        top_k = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(samples):
            for j, sp in enumerate(s.sampling or ()):
                temperature[i, j], top_p[i, j], top_k[i, j] = sp.temperature, sp.top_p, sp.top_k
        processed = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    return {
        **processed,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "behaviour_logprobs": behaviour,
        "exact": exact,
        "token_weights": weights,
        "advantages": adv,
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
    }


def micro_batches(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    *,
    pad_id: int,
    max_tokens: int,
) -> list[dict[str, torch.Tensor]]:
    """Packs samples into micro-batches of at most `max_tokens` padded tokens each (at least one
    sample per micro-batch). Sorting by length keeps padding low."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        # Padded size if sample i joins: every row is as long as the longest (which is i, sorted).
        if current is not None and (len(current) + 1) * len(samples[i].input_ids) <= max_tokens:
            current.append(i)
        else:
            batches.append([i])
    return [pack([samples[i] for i in b], pad_id, [advantages[i] for i in b]) for b in batches]
