"""Full HF checkpoints from a (sharded) training model, written atomically.

A reader (vLLM's reload, the proxy) either sees no `out_dir` or a complete one: files are written to
a temporary sibling directory, fsynced, the directory fsynced, then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer import dist
from trainer.model import TORCH_DTYPES, DType

# Weight files of the base model that the new weights replace (everything else is copied).
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".safetensors.index.json",
    ".bin.index.json",
)
MAX_SHARD_BYTES = 4 * 1024**3
# The input embeddings a tied LM head shares (Llama/Mistral/Qwen layout).
_EMBED_KEY = "model.embed_tokens.weight"


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full, unsharded state dict on CPU, on rank 0; None on other ranks.

    A collective: every rank must call it. LoRA adapters (peft) are merged into the base weights
    and the peft key prefixes removed, so the result loads as the plain base architecture.
    """
    if dist.is_initialized():
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=opts)
        if not dist.is_main():
            return None
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if _is_peft(model):
        state = _merge_lora(state, _lora_scalings(model))
    return state


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def _lora_scalings(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """{module name: (scaling, fan_in_fan_out)} for each LoRA-wrapped layer (default adapter)."""
    out = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling:
            out[name] = (float(scaling["default"]), bool(getattr(module, "fan_in_fan_out", False)))
    return out


def _merge_lora(
    state: dict[str, torch.Tensor], scalings: dict[str, tuple[float, bool]]
) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        merged[key] = value
    for name, (scaling, fan_in_fan_out) in scalings.items():
        weight_key = f"{name}.base_layer.weight"
        a = state[f"{name}.lora_A.default.weight"].float()  # [r, in]
        b = state[f"{name}.lora_B.default.weight"].float()  # [out, r]
        delta = (b @ a) * scaling  # the low-rank update, [out, in]
        if fan_in_fan_out:  # GPT-2 Conv1D stores weights transposed
            delta = delta.T
        w = merged[weight_key]
        merged[weight_key] = (w.float() + delta).to(w.dtype)
    # base_model.model.<hf name>, with the wrapped layer's weight under .base_layer
    prefix = "base_model.model."
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in merged.items()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(state: dict[str, torch.Tensor], dtype: DType, tied: bool) -> dict[str, torch.Tensor]:
    """Cast floats to dtype, write a tied LM head out, make every tensor its own contiguous storage."""
    target = TORCH_DTYPES[dtype]
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        out[key] = (t.to(target) if t.is_floating_point() else t).contiguous()
    if tied and "lm_head.weight" not in out and _EMBED_KEY in out:
        # Keep the tied LM head in the file. vLLM's in-place reload (`reload_weights`, and the NCCL
        # update) re-runs a layer's kernel preparation only for layers whose weights arrive: without
        # `lm_head.weight` the LM head keeps the GEMM it pre-packed from the previous weights (oneDNN
        # on AVX-512/AMX CPUs) and the engine serves old logits on new hidden states. vLLM's loader
        # skips the alias on a fresh start and HF re-ties it, so the copy costs only disk.
        out["lm_head.weight"] = out[_EMBED_KEY]
    # safetensors refuses tensors sharing memory: give any alias its own copy.
    seen: set[int] = set()
    for key, t in out.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            out[key] = t.clone()
        seen.add(ptr)
    return out


def prepared_state(state: dict[str, torch.Tensor], base_dir: Path, dtype: DType) -> dict[str, torch.Tensor]:
    """The tensors `write_checkpoint` writes for `state` (what an NCCL transfer sends instead)."""
    return _prepare(state, dtype, _tied(json.loads((Path(base_dir) / "config.json").read_text())))


def _tied(config: dict) -> bool:
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _write_weights(tensors: dict[str, torch.Tensor], tmp: Path) -> None:
    # Split into shards of at most MAX_SHARD_BYTES, in key order (the HF layout).
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, tmp / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def write_checkpoint(
    state_dict: dict[str, torch.Tensor], *, base_dir: Path, out_dir: Path, dtype: DType
) -> Path:
    """Writes a loadable HF checkpoint (safetensors + config + tokenizer + generation config) at out_dir.

    base_dir provides config and tokenizer files; every non-weight file in it is copied. out_dir must
    not exist yet: a version's checkpoint is written once.
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        config = json.loads((base_dir / "config.json").read_text())
        torch_name = str(TORCH_DTYPES[dtype]).removeprefix("torch.")
        config["dtype"] = torch_name
        if "torch_dtype" in config:
            config["torch_dtype"] = torch_name
        _write_weights(_prepare(state_dict, dtype, _tied(config)), tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

        for src in sorted(base_dir.iterdir()):
            if src.is_file() and src.name != "config.json" and not src.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(src, tmp / src.name)
        if not (tmp / "generation_config.json").exists():
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(base_dir))).save_pretrained(
                str(tmp)
            )

        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        os.rename(tmp, out_dir)  # atomic on one filesystem: readers see all files or none
        _fsync(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --- trainer state: AdamW moments, next to (never inside) the served checkpoints ----------------------
#
# Without it every `atdp train --once` run starts AdamW afresh: m = v = 0, and the first Adam step
# is lr * g / |g|, a sign-SGD step. The state is one file under <checkpoints>/.trainer-state/,
# tagged with the version (name and checkpoint) whose weights it belongs to, and a run resumes it
# only when it loads exactly that version. The served folder stays a plain HF checkpoint for vLLM.

TRAINER_STATE_DIR = ".trainer-state"


def trainer_state_path(checkpoints_dir: Path) -> Path:
    return Path(checkpoints_dir) / TRAINER_STATE_DIR / "optimizer.pt"


def save_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, *, version: str, checkpoint: str
) -> None:
    """Full (unsharded, parameter-name keyed) optimizer state, written atomically by rank 0.
    A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_main():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save({"version": version, "checkpoint": str(checkpoint), "optimizer": osd}, tmp)
        _fsync(tmp)
        os.replace(tmp, path)  # a reader sees the old state or the new one, never half of one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, *, version: str, checkpoint: str
) -> bool:
    """Loads the saved state into `optimizer` if it belongs to (version, checkpoint); True if it did.

    Rank 0 reads the file and broadcasts it. The configured hyper-parameters (lr, weight decay) win
    over the saved ones, so a run may change them and still keep the moments. A collective.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    saved = None
    if dist.is_main() and path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if (saved.get("version"), saved.get("checkpoint")) != (version, str(checkpoint)):
            saved = None  # it belongs to other weights: its moments would point the wrong way
    if not dist.broadcast_object(saved is not None):
        return False
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if dist.is_initialized():
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, optimizer, saved["optimizer"] if saved else {}, options=opts)
    else:
        set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=StateDictOptions())
    for group, h in zip(optimizer.param_groups, hyper, strict=True):
        group.update(h)
    return True
