"""Engine-numerics helpers that need no engine: truncation, and how a profile is resolved."""

from __future__ import annotations

import pytest
import torch

from trainer import numerics


def test_truncation_drops_low_bits_and_passes_gradients():
    x = torch.tensor([1.0 + 2**-8 + 2**-9, -3.0000002, 0.1], requires_grad=True)
    y = numerics.truncate_bf16(x)
    # truncation rounds toward zero; round-to-nearest rounds 1 + 2^-8 + 2^-9 up
    assert y[0].item() == 1.0 and numerics.round_bf16(x)[0].item() == 1.0 + 2**-7
    assert y[1].item() == -3.0
    assert torch.equal(y, y.to(torch.bfloat16).float())  # representable in bf16
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


def test_resolve_named_profile_and_unreachable_engine(tmp_path):
    assert numerics.resolve("bf16-trunc", tmp_path, None) == "bf16-trunc"
    assert numerics.resolve("auto", tmp_path, None) == "fp32"
    # nothing listens there: training goes on with plain fp32 numerics, and says so
    assert numerics.resolve("auto", tmp_path, "http://127.0.0.1:9") == "fp32"
    with pytest.raises(ValueError):
        numerics.resolve("fp16", tmp_path, None)


def _attention_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 5, 8, generator=g)  # 4 query heads over 2 kv heads (grouped)
    k, v = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    return q, k, v


def test_amx_attention_rounds_the_unnormalised_probabilities_and_divides_by_their_fp32_sum():
    q, k, v = _attention_inputs()
    out, _ = numerics._amx_attention(torch.nn.Module(), q, k, v, None, scaling=0.5)
    # by hand, head 3 (kv head 1), every row causal: what vLLM's AMX kernel computes
    r = numerics.round_bf16
    s = (r(q[0, 3]) @ r(k[0, 1]).T) * 0.5
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    want = r((r(e) @ r(v[0, 1])) / e.sum(-1, keepdim=True))
    assert torch.equal(out[0, :, 3], want)  # out is [batch, query, head, dim]
    # and it is not the other reading (the normalised probabilities rounded), which fits the engine worse
    other = r(r(torch.softmax(s, -1)) @ r(v[0, 1]))
    assert not torch.equal(want, other)
    # within bf16 rounding of plain attention
    plain = torch.softmax(s, -1) @ v[0, 1]
    assert torch.allclose(want, plain, atol=0.05)


def test_amx_attention_masks_padding_without_nans_and_passes_gradients():
    q, k, v = (t.requires_grad_() for t in _attention_inputs(1))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    mask[..., 3:, :] = False  # padded query rows: masked out entirely
    out, _ = numerics._amx_attention(torch.nn.Module(), q, k, v, mask)
    assert torch.isfinite(out).all() and (out[0, 3:] == 0).all()
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q, k, v))
