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
