"""`atdp train`: the trainer sidecar (flags override ATDP_TRAIN_* variables; see docs/training.md).

    atdp train --once                                   # one update + swap, then exit
    torchrun --nproc-per-node 2 -m proxy.cli train      # FSDP2 over 2 ranks (gloo on CPU, NCCL on GPU)

torch is imported inside the command, so `atdp --help` stays instant.
"""

from __future__ import annotations

import os

# (flag, env variable, type, default, help)
OPTIONS: list[tuple[str, str, type, object, str]] = [
    ("--min-steps", "ATDP_TRAIN_MIN_STEPS", int, 32, "train once this many rewarded steps wait"),
    ("--interval-s", "ATDP_TRAIN_INTERVAL_S", float, 300.0, "...or after this long, if at least one waits"),
    ("--max-steps", "ATDP_TRAIN_MAX_STEPS", int, 512, "steps per update (lease size)"),
    ("--max-version-lag", "ATDP_TRAIN_MAX_VERSION_LAG", int, 4, "skip steps more versions old than this"),
    ("--lease-ttl-s", "ATDP_TRAIN_LEASE_TTL_S", float, 1800.0, "a crashed trainer's lease expires after this"),
    ("--lr", "ATDP_TRAIN_LR", float, 1e-5, "AdamW learning rate"),
    ("--weight-decay", "ATDP_TRAIN_WEIGHT_DECAY", float, 0.0, "AdamW weight decay"),
    ("--ppo-epochs", "ATDP_TRAIN_PPO_EPOCHS", int, 1, "optimizer steps per batch"),
    ("--mode", "ATDP_TRAIN_MODE", str, "auto", "per_step | concat | auto"),
    ("--turn-discount", "ATDP_TRAIN_TURN_DISCOUNT", float, 1.0, "earlier turns get reward * discount**k"),
    ("--max-len", "ATDP_TRAIN_MAX_LEN", int, 4096, "tokens per sample (cut on the right)"),
    ("--micro-batch-tokens", "ATDP_TRAIN_MICRO_BATCH_TOKENS", int, 8192, "padded tokens per micro-batch"),
    ("--clip-low", "ATDP_TRAIN_CLIP_LOW", float, 0.2, "PPO clip epsilon below 1"),
    ("--clip-high", "ATDP_TRAIN_CLIP_HIGH", float, 0.28, "PPO clip epsilon above 1"),
    ("--ratio-mask-low", "ATDP_TRAIN_RATIO_MASK_LOW", float, 0.5, "drop tokens with p_train/p_engine below"),
    ("--ratio-mask-high", "ATDP_TRAIN_RATIO_MASK_HIGH", float, 2.0, "...or above this"),
    ("--max-grad-norm", "ATDP_TRAIN_MAX_GRAD_NORM", float, 1.0, "gradient clipping"),
    ("--kl-mask", "ATDP_TRAIN_KL_MASK", float, 0.0, "drop tokens with Bernoulli KL(train, engine) above (0: off)"),
    ("--kl-coef", "ATDP_TRAIN_KL_COEF", float, 0.0, "KL penalty coefficient, k3 estimator (0: off)"),
    ("--kl-ref", "ATDP_TRAIN_KL_REF", str, "behaviour", "KL reference: behaviour | base | a checkpoint path"),
    ("--temperature", "ATDP_TRAIN_TEMPERATURE", float, 1.0, "logprob temperature (1: the engine's raw logprobs)"),
    ("--weighting", "ATDP_TRAIN_WEIGHTING", str, "token", "loss weight: token | session (each session once)"),
    ("--optimizer-state", "ATDP_TRAIN_OPTIMIZER_STATE", str, "fresh",
     "keep: AdamW state carries over between updates and --once runs; fresh: each update starts anew"),
    ("--normalize-std", "ATDP_TRAIN_NORMALIZE_STD", int, 1, "1: divide advantages by the group's reward std"),
    ("--dtype", "ATDP_TRAIN_DTYPE", str, "fp32", "master weights: fp32 | bf16"),
    ("--compute-dtype", "ATDP_TRAIN_COMPUTE_DTYPE", str, "", "bf16: bf16 compute under FSDP2 (default: as stored)"),
    ("--save-dtype", "ATDP_TRAIN_SAVE_DTYPE", str, "fp32", "checkpoint dtype (the engine casts to its own)"),
    ("--engine-numerics", "ATDP_TRAIN_ENGINE_NUMERICS", str, "auto",
     "auto: probe the engine for how it rounds; or fp32 | bf16 | bf16-trunc (trainer/numerics.py)"),
    ("--lora-r", "ATDP_TRAIN_LORA_R", int, 0, "LoRA rank (0: full fine-tuning)"),
    ("--seed", "ATDP_TRAIN_SEED", int, 0, "torch seed"),
    ("--max-updates", "ATDP_TRAIN_MAX_UPDATES", int, 0, "stop after this many updates (0: never)"),
    ("--proxy-url", "ATDP_PROXY_URL", str, "", "the proxy (default http://ATDP_HOST:ATDP_PORT)"),
]


def _default(env: str, kind: type, default: object) -> object:
    value = os.environ.get(env)
    return kind(value) if value not in (None, "") else default


def cmd_train(args) -> int:
    import logging

    from proxy.config import load_settings
    from proxy.db import database_url
    from trainer.loop import TrainConfig, run
    from trainer.loss import PPOOptions

    for name in ("httpx", "httpcore", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    settings = load_settings()
    cfg = TrainConfig(
        database_url=database_url(settings),
        proxy_url=args.proxy_url or f"http://{settings.host}:{settings.port}",
        admin_key=settings.admin_key,
        checkpoints_dir=settings.checkpoints_dir,
        min_steps=args.min_steps,
        interval_s=args.interval_s,
        once=args.once,
        max_updates=args.max_updates or None,
        max_steps=args.max_steps,
        max_version_lag=args.max_version_lag,
        lease_ttl_s=args.lease_ttl_s,
        mode=args.mode,
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
        engine_url=settings.upstream_urls[0] if settings.upstream_urls else None,
        engine_api_key=settings.upstream_api_key,
        lora_r=args.lora_r,
        seed=args.seed,
    )
    results = run(cfg)
    if args.once and not results:
        return 3  # nothing to train on
    return 0 if all(r.status == "serving" for r in results) else 1


def register(sub) -> None:
    p = sub.add_parser("train", help="run the trainer sidecar (under torchrun for several ranks)")
    p.add_argument("--once", action="store_true", help="one update + swap on the steps available now, then exit")
    for flag, env, kind, default, text in OPTIONS:
        p.add_argument(flag, type=kind, default=_default(env, kind, default), help=f"{text} ({env})")
    p.set_defaults(func=cmd_train)
