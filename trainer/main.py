"""`atdp train`: the trainer sidecar (flags override ATDP_TRAIN_* settings; see docs/training.md).

    atdp train --once                                   # one update + swap, then exit
    torchrun --nproc-per-node 2 -m proxy.cli train      # FSDP2 over 2 ranks (gloo on CPU, NCCL on GPU)

torch is imported inside the command, so `atdp --help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Literal, get_args, get_origin

if TYPE_CHECKING:
    from proxy.config import Settings
    from trainer.gate import DiagnosisGate
    from trainer.loop import TrainConfig

WHEN = ("always", "diagnosed")
SAMPLES = ("step", "trajectory")

# Flags and the settings they override (`--min-steps` -> ATDP_TRAIN_MIN_STEPS, `--proxy-url` ->
# ATDP_PROXY_URL). Types, defaults and help come from proxy.config.Settings: one place.
FLAG_FIELDS: tuple[str, ...] = (
    "train_min_steps", "train_interval_s", "train_max_steps", "train_max_version_lag", "train_lease_ttl_s",
    "train_lr", "train_weight_decay", "train_ppo_epochs", "train_samples", "train_turn_discount", "train_max_len",
    "train_micro_batch_tokens", "train_clip_low", "train_clip_high", "train_ratio_mask_low",
    "train_ratio_mask_high", "train_max_grad_norm", "train_kl_mask", "train_kl_coef", "train_kl_ref",
    "train_temperature", "train_weighting", "train_optimizer_state", "train_normalize_std", "train_dtype",
    "train_compute_dtype", "train_save_dtype", "train_engine_numerics", "train_behaviour_logprobs", "train_lora_r", "train_seed",
    "train_max_updates", "train_when", "proxy_url",
)


def _flag(field: str) -> str:
    return "--" + field.removeprefix("train_").replace("_", "-")


def diagnosis_gate(when: str, settings: Settings) -> DiagnosisGate | None:
    """`--when diagnosed`: a gate that holds training until the diagnosis recommends a policy update."""
    if when not in WHEN:
        raise SystemExit(f"atdp train: --when must be one of {', '.join(WHEN)}, not {when!r}")
    if when == "always":
        return None
    from proxy.evolve.rules import RulesError, load_rules
    from trainer.gate import DiagnosisGate

    try:
        return DiagnosisGate(load_rules(settings.diagnosis_file))
    except RulesError as e:
        raise SystemExit(f"atdp train: {e}") from None


def sample_mode(samples: str, turn_discount: float) -> str:
    """`--samples`, checked before anything starts (trainer/batch.py: build_samples)."""
    if samples not in SAMPLES:
        raise SystemExit(f"atdp train: --samples must be one of {', '.join(SAMPLES)}, not {samples!r}")
    if samples == "trajectory" and turn_discount != 1.0:
        raise SystemExit("atdp train: --turn-discount applies to --samples step only (a trajectory gives every "
                         "turn the session's reward)")
    return samples


def trainer_key(settings: Settings) -> str | None:
    """The key the trainer registers versions with: ATDP_TRAINER_KEY (scoped to versions:write),
    else the admin key (with a warning: the trainer needs no more than registering versions)."""
    if settings.trainer_key:
        return settings.trainer_key
    if settings.admin_key:
        logging.getLogger("atdp.trainer").warning(
            "ATDP_TRAINER_KEY is not set: registering versions with the admin key; create a scoped one with "
            "`atdp keys create --tenant T --scope versions:write`")
    return settings.admin_key


def train_config(args: argparse.Namespace, settings: Settings) -> TrainConfig:
    """What `atdp train` runs with: its flags (defaults: the settings) and the tenant policies the
    settings name (ATDP_POLICY_FILE, ATDP_PRODUCTION), checked again when steps are loaded."""
    from proxy.governance.policies import Policies
    from proxy.store.db import database_url
    from trainer.loop import TrainConfig
    from trainer.loss import PPOOptions

    return TrainConfig(
        database_url=database_url(settings),
        proxy_url=args.proxy_url or f"http://{settings.host}:{settings.port}",
        proxy_key=trainer_key(settings),
        checkpoints_dir=settings.checkpoints_dir,
        min_steps=args.min_steps,
        interval_s=args.interval_s,
        once=args.once,
        max_updates=args.max_updates or None,
        max_steps=args.max_steps,
        max_version_lag=args.max_version_lag,
        lease_ttl_s=args.lease_ttl_s,
        samples=sample_mode(args.samples, args.turn_discount),
        turn_discount=args.turn_discount,
        max_len=args.max_len,
        micro_batch_tokens=args.micro_batch_tokens,
        normalize_std=bool(args.normalize_std),
        weighting=args.weighting,
        optimizer_state=args.optimizer_state,
        lr=args.lr,
        weight_decay=args.weight_decay,
        ppo_epochs=args.ppo_epochs,
        ppo=PPOOptions(clip_eps_low=args.clip_low, clip_eps_high=args.clip_high, ratio_mask_low=args.ratio_mask_low,
                       ratio_mask_high=args.ratio_mask_high, max_grad_norm=args.max_grad_norm or None,
                       kl_mask=args.kl_mask or None, kl_coef=args.kl_coef, kl_ref=args.kl_ref,
                       temperature=args.temperature),
        dtype=args.dtype,
        compute_dtype=args.compute_dtype or None,
        save_dtype=args.save_dtype,
        engine_numerics=args.engine_numerics or "auto",
        behaviour_logprobs=args.behaviour_logprobs or "auto",
        engine_url=settings.upstream_urls[0] if settings.upstream_urls else None,
        engine_api_key=settings.upstream_api_key,
        weight_transfer=settings.weight_transfer,
        lora_r=args.lora_r,
        seed=args.seed,
        policies=Policies.from_settings(settings),
        gate=diagnosis_gate(args.when, settings),
    )


def cmd_train(args: argparse.Namespace) -> int:
    import logging

    from atdp_schema.models import VersionStatus
    from proxy.config import load_settings
    from trainer.loop import run

    for name in ("httpx", "httpcore", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cfg = train_config(args, load_settings())
    results = run(cfg)
    if args.once and not results:
        return 3  # nothing to train on
    return 0 if all(r.status == VersionStatus.serving for r in results) else 1


def register(sub) -> None:
    from proxy.config import Settings, read_settings

    # Defaults are the settings (ATDP_TRAIN_*, ATDP_PROXY_URL, the TOML file); a flag overrides.
    current = read_settings()
    p = sub.add_parser("train", help="run the trainer sidecar (under torchrun for several ranks)")
    p.add_argument("--once", action="store_true", help="one update + swap on the steps available now, then exit")
    for field in FLAG_FIELDS:
        info = Settings.model_fields[field]
        kind = info.annotation if info.annotation in (int, float) else str
        # A Literal setting's values are the flag's choices: argparse names them when one is wrong.
        choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
        p.add_argument(_flag(field), dest=field.removeprefix("train_"), type=kind, default=getattr(current, field),
                       choices=choices, help=f"{info.description} (ATDP_{field.upper()}, default {info.default!r})")
    p.set_defaults(func=cmd_train)
