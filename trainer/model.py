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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer import dist
from trainer.numerics import Profile, emulate

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
    engine_numerics: Profile | None = None,
) -> nn.Module:
    """A HF causal LM in training mode, on the CPU (shard() moves it to the rank's device).

    dtype is the storage dtype of the weights (and of the optimizer's view of them). For bf16
    compute with fp32 master weights, load fp32 and pass compute_dtype="bf16" to shard().
    engine_numerics: compute the forward the way the serving engine rounds (a profile of
    trainer/numerics.py, e.g. from `numerics.resolve`); use with dtype="fp32" and no compute_dtype.
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
    if engine_numerics not in (None, "fp32"):
        emulate(model, engine_numerics)
    model.train()
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
