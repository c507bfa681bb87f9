"""The trainer's settings: one section of `proxy.config.Settings`, written once.

`Settings.train.<name>` is the variable `ATDP_TRAIN_<NAME>`, the TOML key `train_<name>` (or `<name>` in a
`[train]` table) and the flag `--<name>` of `atdp train`; trainer.loop.TrainConfig holds it as `train`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The trainer's choices (TrainSettings).
SampleMode = Literal["step", "trajectory"]
Weighting = Literal["token", "session"]
OptimizerState = Literal["fresh", "keep"]
EngineNumerics = Literal["auto", "fp32", "bf16", "bf16-amx", "bf16-trunc"]
BehaviourLogprobs = Literal["auto", "processed", "raw"]


class TrainSettings(BaseModel):
    """The trainer's settings (`atdp train`; trainer.loop.TrainConfig holds them as `train`).

    Each is written once, here: `Settings.train.<name>` is the variable `ATDP_TRAIN_<NAME>`, the TOML
    key `train_<name>` (or `<name>` in a `[train]` table) and the flag `--<name>` (dashes for
    underscores), whose help is the description.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_steps: int = Field(32, description="train once this many rewarded steps wait")
    interval_s: float = Field(300.0, description="...or after this long, if at least one waits")
    max_steps: int = Field(512, description="steps per update (lease size)")
    max_version_lag: int = Field(4, description="skip steps more versions old than this")
    lease_ttl_s: float = Field(1800.0, description="a crashed trainer's lease expires after this")
    lr: float = Field(1e-5, description="AdamW learning rate")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    ppo_epochs: int = Field(1, description="optimizer steps per batch")
    samples: SampleMode = Field("trajectory", description="step: one sample per step; trajectory: a session whose "
                                "prompts extend each other token for token is one sequence (else per step)")
    turn_discount: float = Field(1.0, description="step samples: earlier turns get reward * discount**k")
    max_len: int = Field(4096, description="tokens per sample (cut on the right)")
    micro_batch_tokens: int = Field(8192, description="padded tokens per micro-batch")
    clip_low: float = Field(0.2, description="PPO clip epsilon below 1")
    clip_high: float = Field(0.28, description="PPO clip epsilon above 1")
    ratio_mask_low: float = Field(0.5, description="drop tokens with p_train/p_engine below")
    ratio_mask_high: float = Field(2.0, description="...or above this")
    max_grad_norm: float = Field(1.0, description="gradient clipping")
    kl_mask: float = Field(0.0, description="drop tokens with Bernoulli KL(train, engine) above (0: off)")
    kl_coef: float = Field(0.0, description="KL penalty coefficient, k3 estimator (0: off)")
    kl_ref: str = Field("behaviour", description="KL reference: behaviour | base | a checkpoint path")
    temperature: float = Field(1.0, description="logprob temperature (1: the engine's raw logprobs)")
    weighting: Weighting = Field("token", description="loss weight: token | session (each session once)")
    # fresh by default until the e2e learning step size is re-derived for kept state (docs/training.md)
    optimizer_state: OptimizerState = Field(
        "fresh", description="keep: AdamW state carries over between updates and --once runs; fresh: each starts anew")
    normalize_std: int = Field(1, description="1: divide advantages by the group's reward std")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="master weights: fp32 | bf16")
    compute_dtype: Literal["", "bf16"] = Field("", description="bf16: bf16 compute under FSDP2 (default: as stored)")
    save_dtype: Literal["fp32", "bf16"] = Field("fp32", description="checkpoint dtype (the engine casts to its own)")
    engine_numerics: EngineNumerics = Field(
        "auto", description="auto: probe the engine for how it rounds; or fp32 | bf16 | bf16-amx | bf16-trunc (trainer/numerics.py)")
    behaviour_logprobs: BehaviourLogprobs = Field(
        "auto", description="auto: ask the engine; processed: vLLM reports logprobs after temperature/top-p "
        "(--logprobs-mode processed_logprobs), each step is recomputed with its sampling; raw: temperature 1")
    lora_r: int = Field(0, description="LoRA rank (0: full fine-tuning)")
    seed: int = Field(0, description="torch seed")
    max_updates: int = Field(0, description="stop after this many updates (0: never)")
    when: Literal["always", "diagnosed"] = Field(
        "always", description="always | diagnosed: update only while `atdp diagnose` recommends a policy update "
        "(docs/diagnosis.md)")


# The trainer's settings written flat (ATDP_TRAIN_<NAME>, the TOML file's train_<name>): each source moves
# them into `train` itself, so the environment wins over the file per setting, and a key over [train].
TRAIN_VARIABLE, TRAIN_KEY = "atdp_train_", "train_"


def gather_train(data: dict[str, Any], flat: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """`data` (one source's values) with the settings `flat` names `<prefix><name>` in its `train` section;
    other `<prefix>*` names are no settings and stay ignored (ATDP_TRAIN_NPROC is docker-compose's)."""
    section = {name: flat[prefix + name] for name in TrainSettings.model_fields if prefix + name in flat}
    if section:
        table = data.get("train")
        data["train"] = {**table, **section} if isinstance(table, dict) else section
    return data


def train_names(loc: tuple[int | str, ...]) -> str:
    """How a trainer setting is written: `ATDP_TRAIN_LR (train_lr)`."""
    name = "_".join(str(part) for part in loc)
    return f"ATDP_TRAIN_{name.upper()} (train_{name})" if name else "train"
