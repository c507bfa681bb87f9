"""Processed logprobs: the distribution a token was sampled from (temperature, top-k, top-p)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.batch import StepTokens, build_samples, pack
from trainer.loss import token_logprobs
from trainer.sampling import PLAIN, Sampling, from_params, processed_logprobs


def _reference(logits: list[float], target: int, s: Sampling) -> float:
    """The same distribution written the textbook way: scale, keep the k largest, keep the smallest
    set of largest tokens whose probability reaches p, renormalise."""
    scaled = [x / s.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if s.top_k:
        kth = scaled[order[min(s.top_k, len(order)) - 1]]
        order = [i for i in order if scaled[i] >= kth]
    z = sum(math.exp(scaled[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += math.exp(scaled[i]) / z
        if mass >= s.top_p - 1e-12:
            break
    if target not in kept:
        return -math.inf
    zk = sum(math.exp(scaled[i]) for i in kept)
    return scaled[target] - math.log(zk)


@pytest.mark.parametrize("sampling", [Sampling(0.7, 0.9, 0), Sampling(1.3, 1.0, 5), Sampling(0.5, 0.8, 20),
                                      Sampling(1.0, 0.6, 0), Sampling(2.0, 1.0, 0)])
def test_processed_logprobs_match_the_textbook_distribution(sampling):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    targets = torch.randint(0, 50, (64,), generator=g)
    n = len(targets)
    got = processed_logprobs(logits, targets, torch.full((n,), sampling.temperature), torch.full((n,), sampling.top_p),
                             torch.full((n,), sampling.top_k))
    for row in range(n):
        want = _reference(logits[row].tolist(), int(targets[row]), sampling)
        if math.isinf(want):
            assert math.isinf(got[row].item()) and got[row].item() < 0
        else:
            assert got[row].item() == pytest.approx(want, abs=1e-4)
    assert torch.isinf(got).any() or sampling.top_p == 1.0 and sampling.top_k == 0  # the cases do cut tokens


def test_the_most_likely_token_always_stays():
    logits = torch.tensor([[0.0, 10.0, 1.0]])
    got = processed_logprobs(logits, torch.tensor([1]), torch.tensor([1.0]), torch.tensor([0.01]), torch.tensor([0]))
    assert got.item() == 0.0  # the nucleus is that one token


def test_from_params():
    assert from_params({}) == PLAIN and from_params(None) == PLAIN
    assert from_params({"temperature": 0}) == PLAIN  # greedy: vLLM reports the raw distribution
    assert from_params({"temperature": 0.7, "top_p": 0.9}) == Sampling(0.7, 0.9, 0)
    assert from_params({"temperature": 0.7, "top_k": 40}) == Sampling(0.7, 1.0, 40)
    assert from_params({"top_k": -1}) == PLAIN  # vLLM's "off"
    assert from_params({"temperature": "hot", "top_p": True, "top_k": None}) == PLAIN  # not numbers: defaults
    assert from_params({"top_p": 1.5}) == PLAIN
    assert from_params({"temperature": float("nan")}) == PLAIN


def _step(i: int, prompt: list[int], out: list[int], sampling: Sampling, session: str = "s") -> StepTokens:
    return StepTokens(step_id=str(i), session_id=session, task_id=None, seq=i, prompt_ids=prompt, output_ids=out,
                      behaviour_logprobs=[-1.0] * len(out), output_versions=["v"] * len(out),
                      output_mask=[1] * len(out), prompt_exact=True, reward=1.0, version_lag=0, sampling=sampling)


def test_pack_carries_each_tokens_sampling_also_in_concatenated_sessions():
    hot, cold = Sampling(1.2, 0.95, 0), Sampling(0.5, 1.0, 10)
    first = _step(0, [1, 2], [3, 4], hot)
    second = _step(1, [1, 2, 3, 4, 5], [6], cold)
    (sample,) = build_samples([first, second], mode="trajectory", turn_discount=1.0, max_len=64)
    batch = pack([sample], pad_id=0, advantages=[0.0])
    assert batch["temperature"][0].tolist()[:6] == pytest.approx([1, 1, 1.2, 1.2, 1, 0.5])
    assert batch["top_k"][0].tolist()[:6] == [0, 0, 0, 0, 0, 10]
    plain = build_samples([_step(0, [1, 2], [3], PLAIN, "p")], mode="step", turn_discount=1.0, max_len=64)
    assert "temperature" not in pack(plain, pad_id=0, advantages=[0.0])


def test_token_logprobs_use_the_processed_distribution_only_where_asked():
    torch.manual_seed(0)
    vocab = 11

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, vocab)

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return type("Out", (), {"logits": self.emb(input_ids) * 3})()

    model = Toy()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    mask = torch.ones_like(ids)
    raw = token_logprobs(model, ids, mask)
    sampling = {"temperature": torch.tensor([[1, 1, 0.5, 1, 1]], dtype=torch.float32),
                "top_p": torch.tensor([[1, 1, 1, 0.9, 1]], dtype=torch.float32),
                "top_k": torch.zeros((1, 5), dtype=torch.long)}
    got = token_logprobs(model, ids, mask, sampling=sampling)
    assert got[0, [0, 1, 4]].tolist() == raw[0, [0, 1, 4]].tolist()  # plain tokens: unchanged
    logits = model(ids).logits[0].float()
    want2 = torch.log_softmax(logits[1] / 0.5, -1)[3]
    assert got[0, 2].item() == pytest.approx(want2.item(), abs=1e-5)
    assert got[0, 3].item() == pytest.approx(_reference(logits[2].tolist(), 4, Sampling(1.0, 0.9, 0)), abs=1e-5)
    got[0, 2].backward()  # differentiable through the processed rows
    assert model.emb.weight.grad is not None and model.emb.weight.grad.abs().sum() > 0
