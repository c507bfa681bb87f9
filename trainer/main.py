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
    from proxy.config import Settings, TrainSettings
    from trainer.gate import DiagnosisGate
    from trainer.loop import TrainConfig


def _flag(name: str) -> str:
    """A trainer setting's flag: `max_steps` -> `--max-steps` (ATDP_TRAIN_MAX_STEPS)."""
    return "--" + name.replace("_", "-")


def diagnosis_gate(when: str, settings: Settings) -> DiagnosisGate | None:
    """`--when diagnosed`: a gate that holds training until the diagnosis recommends a policy update."""
    from proxy.config import TrainSettings

    choices = get_args(TrainSettings.model_fields["when"].annotation)
    if when not in choices:
        raise SystemExit(f"atdp train: --when must be one of {', '.join(choices)}, not {when!r}")
    if when == "always":
        return None
    from proxy.evolve.rules import RulesError, load_rules
    from trainer.gate import DiagnosisGate

    try:
        return DiagnosisGate(load_rules(settings.diagnosis_file))
    except RulesError as e:
        raise SystemExit(f"atdp train: {e}") from None


def check_samples(train: TrainSettings) -> None:
    """`--turn-discount` with `--samples trajectory`, refused before anything starts (trainer/batch.py:
    build_samples)."""
    if train.samples == "trajectory" and train.turn_discount != 1.0:
        raise SystemExit("atdp train: --turn-discount applies to --samples step only (a trajectory gives every "
                         "turn the session's reward)")


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


def train_settings(args: argparse.Namespace, settings: Settings) -> TrainSettings:
    """The trainer's settings: `settings.train` with the flags' values over it, validated again."""
    from proxy.config import TrainSettings

    flags = {name: getattr(args, name) for name in TrainSettings.model_fields if hasattr(args, name)}
    return TrainSettings.model_validate(settings.train.model_dump() | flags)


def train_config(args: argparse.Namespace, settings: Settings) -> TrainConfig:
    """What `atdp train` runs with: its flags (defaults: the settings) and the tenant policies the
    settings name (ATDP_POLICY_FILE, ATDP_PRODUCTION), checked again when steps are loaded."""
    from proxy.governance.policies import Policies
    from proxy.store.db import database_url
    from trainer.loop import TrainConfig

    train = train_settings(args, settings)
    check_samples(train)
    return TrainConfig(
        database_url=database_url(settings),
        proxy_url=args.proxy_url or f"http://{settings.host}:{settings.port}",
        proxy_key=trainer_key(settings),
        checkpoints_dir=settings.checkpoints_dir,
        train=train,
        once=args.once,
        engine_url=settings.upstream_urls[0] if settings.upstream_urls else None,
        engine_api_key=settings.upstream_api_key,
        weight_transfer=settings.weight_transfer,
        policies=Policies.from_settings(settings),
        gate=diagnosis_gate(train.when, settings),
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
    from proxy.config import Settings, TrainSettings, read_settings

    # Defaults are the settings (ATDP_TRAIN_*, ATDP_PROXY_URL, the TOML file); a flag overrides.
    current = read_settings()
    p = sub.add_parser("train", help="run the trainer sidecar (under torchrun for several ranks)")
    p.add_argument("--once", action="store_true", help="one update + swap on the steps available now, then exit")
    for name, info in TrainSettings.model_fields.items():  # one flag per trainer setting
        kind = info.annotation if info.annotation in (int, float) else str
        # A Literal setting's values are the flag's choices: argparse names them when one is wrong.
        choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
        p.add_argument(_flag(name), dest=name, type=kind, default=getattr(current.train, name), choices=choices,
                       help=f"{info.description} (ATDP_TRAIN_{name.upper()}, default {info.default!r})")
    info = Settings.model_fields["proxy_url"]
    p.add_argument("--proxy-url", default=current.proxy_url,
                   help=f"{info.description} (ATDP_PROXY_URL, default {info.default!r})")
    p.set_defaults(func=cmd_train)
