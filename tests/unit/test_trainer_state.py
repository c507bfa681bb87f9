"""What the trainer keeps between updates and refuses to publish (no database needed).

The optimizer state is saved next to the checkpoints, reloaded by a fresh process only for the
version it belongs to, and equal after the round trip; non-finite losses or weights are caught.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from proxy.config import TrainSettings
from tests.trainer_tiny import build_tiny_llama
from trainer.batch import StepTokens, build_samples
from trainer.checkpoint import TRAINER_STATE_DIR, load_optimizer_state, trainer_state_path
from trainer.loop import Plan, Policy, TrainConfig, non_finite, ppo_options
from trainer.loss import PPOOptions, group_advantages


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "base", seed=0)


def _cfg(home: Path, lr: float = 1e-3) -> TrainConfig:
    train = TrainSettings(engine_numerics="fp32", optimizer_state="keep", lr=lr, ratio_mask_low=0.0,
                          ratio_mask_high=math.inf)
    return TrainConfig(database_url="", proxy_url="", proxy_key=None, checkpoints_dir=home / "checkpoints", train=train)


def _plan(version: str, checkpoint: Path) -> Plan:
    steps = [
        StepTokens(step_id=f"s{k}", session_id=f"s{k}", task_id="t", seq=0, prompt_ids=[5, 6, 7 + k],
                   output_ids=[8, 9, 10], behaviour_logprobs=[-5.0] * 3, output_versions=[version] * 3,
                   output_mask=[1, 1, 1], prompt_exact=True, reward=float(k), version_lag=0)
        for k in range(2)
    ]
    samples = build_samples(steps, mode="step", turn_discount=1.0, max_len=64)
    adv = group_advantages([s.reward for s in samples], [s.group for s in samples], normalize_std=True)
    return Plan(kind="train", samples=samples, advantages=adv, version_name=version, checkpoint=str(checkpoint))


def _state(policy: Policy) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(policy.model, policy.optimizer)
    return {f"{name}.{k}": v for name, st in osd["state"].items() for k, v in st.items()}


def test_optimizer_state_is_saved_reloaded_and_equal(tiny_dir, tmp_path):
    cfg = _cfg(tmp_path)
    first = Policy(cfg)
    first.ensure("base", str(tiny_dir))
    assert not first.resumed  # nothing saved yet: AdamW starts afresh
    stats = first.update(_plan("base", tiny_dir))
    assert stats["optimizer_resumed"] is False
    first.update(_plan("base", tiny_dir))  # two steps: moments and step count are not the defaults
    first.save_state()
    path = trainer_state_path(cfg.checkpoints_dir)
    assert path.parent == cfg.checkpoints_dir / TRAINER_STATE_DIR  # beside, not inside, the served folders
    saved = _state(first)
    assert saved and all(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("exp_avg_sq"))

    # A fresh process (the next `--once` run) loading the same version resumes the same moments.
    again = Policy(_cfg(tmp_path, lr=5e-4))
    again.ensure("base", str(tiny_dir))
    assert again.resumed
    loaded = _state(again)
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
    assert again.optimizer.param_groups[0]["lr"] == 5e-4  # the configured lr, not the saved one
    assert again.update(_plan("base", tiny_dir))["optimizer_resumed"] is True

    # Another version's weights (or the same name at another path) start afresh.
    for version, checkpoint in (("v7", str(tiny_dir)), ("base", str(tmp_path / "elsewhere"))):
        assert not load_optimizer_state(again.model, again.optimizer, path, version=version, checkpoint=checkpoint)


def test_non_finite_loss_or_weights_are_named():
    good = {"w": torch.ones(2), "ids": torch.tensor([1, 2])}
    assert non_finite(good, {"loss": 0.5}) is None
    assert "loss" in non_finite(good, {"loss": float("nan")})
    assert "loss" in non_finite(good, {})
    bad = {**good, "layer.weight": torch.tensor([1.0, float("inf")])}
    assert "layer.weight" in non_finite(bad, {"loss": 0.5})


def test_every_loss_option_is_an_atdp_train_flag(monkeypatch, tmp_path):
    import argparse

    import trainer.loop
    from trainer import main

    monkeypatch.setenv("ATDP_HOME", str(tmp_path))
    monkeypatch.setenv("ATDP_TRAIN_KL_COEF", "0.3")  # environment default, overridden by nothing
    parser = argparse.ArgumentParser()
    main.register(parser.add_subparsers())
    seen: list[TrainConfig] = []
    monkeypatch.setattr(trainer.loop, "run", lambda cfg: seen.append(cfg) or [])

    args = parser.parse_args(["train", "--once"])
    assert args.func(args) == 3
    cfg = seen[-1]
    assert cfg.ppo.kl_mask is None and cfg.ppo.kl_coef == 0.3 and cfg.ppo.kl_ref == "behaviour"
    assert cfg.train.weighting == "token" and cfg.train.normalize_std and cfg.ppo.temperature == 1.0
    assert cfg.train.optimizer_state == "fresh"

    args = parser.parse_args(["train", "--once", "--kl-mask", "0.05", "--kl-coef", "0.1", "--kl-ref", "base",
                              "--weighting", "session", "--normalize-std", "0", "--temperature", "0.7",
                              "--optimizer-state", "keep"])
    args.func(args)
    cfg = seen[-1]
    assert (cfg.ppo.kl_mask, cfg.ppo.kl_coef, cfg.ppo.kl_ref, cfg.ppo.temperature) == (0.05, 0.1, "base", 0.7)
    assert cfg.train.weighting == "session" and cfg.train.normalize_std == 0 and cfg.train.optimizer_state == "keep"
    # every PPOOptions field has a flag
    flags = {main._flag(name) for name in TrainSettings.model_fields}
    for name, flag in {"clip_eps_low": "--clip-low", "clip_eps_high": "--clip-high", "kl_mask": "--kl-mask",
                       "ratio_mask_low": "--ratio-mask-low", "ratio_mask_high": "--ratio-mask-high",
                       "temperature": "--temperature", "max_grad_norm": "--max-grad-norm", "kl_coef": "--kl-coef",
                       "kl_ref": "--kl-ref"}.items():
        assert name in PPOOptions.__dataclass_fields__ and flag in flags
    assert set(PPOOptions.__dataclass_fields__) == {
        "clip_eps_low", "clip_eps_high", "ratio_mask_low", "ratio_mask_high", "kl_mask", "temperature",
        "max_grad_norm", "kl_coef", "kl_ref"}


def test_samples_flag_and_config_file(monkeypatch, tmp_path, capsys):
    import argparse

    import trainer.loop
    from trainer import main

    (tmp_path / "atdp.toml").write_text('train_samples = "step"\ntrain_turn_discount = 0.5\n')
    monkeypatch.setenv("ATDP_HOME", str(tmp_path))
    monkeypatch.setenv("ATDP_CONFIG", str(tmp_path / "atdp.toml"))
    seen: list[TrainConfig] = []
    monkeypatch.setattr(trainer.loop, "run", lambda cfg: seen.append(cfg) or [])

    def train(*flags: str) -> TrainConfig:
        parser = argparse.ArgumentParser()
        main.register(parser.add_subparsers())  # defaults read now: the file's
        args = parser.parse_args(["train", "--once", *flags])
        args.func(args)
        return seen[-1]

    assert (train().train.samples, train().train.turn_discount) == ("step", 0.5)  # from the config file
    assert train("--samples", "trajectory", "--turn-discount", "1").train.samples == "trajectory"
    with pytest.raises(SystemExit, match="turn-discount"):  # a trajectory has one reward for every turn
        train("--samples", "trajectory")
    with pytest.raises(SystemExit):  # the setting's Literal values are the flag's choices
        train("--samples", "concat")
    assert "argument --samples: invalid choice: 'concat' (choose from" in capsys.readouterr().err
    (tmp_path / "atdp.toml").write_text('train_samples = "concat"\n')  # the settings refuse it too, by name
    with pytest.raises(Exception, match="train_samples"):
        train()
    with pytest.raises(ValueError, match="turn_discount"):
        TrainConfig(database_url="x", proxy_url="x", proxy_key=None, checkpoints_dir=tmp_path,
                    train=TrainSettings(turn_discount=0.5))


def test_variables_file_and_flags_land_in_the_train_config(monkeypatch, tmp_path):
    """One definition (proxy.config.TrainSettings): ATDP_TRAIN_* over the TOML file's train_* keys,
    flags over both, and all of it is `TrainConfig.train`; a bad variable is refused by name."""
    import argparse

    from pydantic import ValidationError

    import trainer.loop
    from trainer import main

    (tmp_path / "atdp.toml").write_text('train_max_steps = 64\ntrain_kl_ref = "base"\ntrain_lora_r = 4\n')
    monkeypatch.setenv("ATDP_HOME", str(tmp_path))
    monkeypatch.setenv("ATDP_CONFIG", str(tmp_path / "atdp.toml"))
    for name in [k for k in os.environ if k.startswith("ATDP_TRAIN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ATDP_TRAIN_LR", "3e-5")
    monkeypatch.setenv("ATDP_TRAIN_MAX_STEPS", "128")  # the environment wins over the file
    seen: list[TrainConfig] = []
    monkeypatch.setattr(trainer.loop, "run", lambda cfg: seen.append(cfg) or [])

    def train(*flags: str) -> TrainConfig:
        parser = argparse.ArgumentParser()
        main.register(parser.add_subparsers())
        args = parser.parse_args(["train", "--once", *flags])
        args.func(args)
        return seen[-1]

    cfg = train("--seed", "7")
    assert cfg.train == TrainSettings(lr=3e-5, max_steps=128, kl_ref="base", lora_r=4, seed=7)
    assert cfg.ppo.kl_ref == "base" and cfg.once
    cfg = train("--lr", "1e-4", "--max-steps", "16", "--kl-ref", "behaviour", "--max-grad-norm", "0")
    assert (cfg.train.lr, cfg.train.max_steps, cfg.train.lora_r) == (1e-4, 16, 4)
    assert cfg.ppo.kl_ref == "behaviour" and cfg.ppo.max_grad_norm is None  # 0: off
    monkeypatch.setenv("ATDP_TRAIN_MAX_STEPS", "many")
    with pytest.raises(ValidationError, match=r"ATDP_TRAIN_MAX_STEPS \(train_max_steps\)"):
        train()


def test_the_trainers_defaults_are_its_settings_defaults(monkeypatch, tmp_path):
    """`atdp train` with no flag and no setting runs what `TrainConfig()` and `PPOOptions()` say: the
    settings' defaults are TrainSettings', and PPOOptions' own defaults (the loss's, used by the
    benchmarks) must be what TrainSettings' give."""
    import argparse
    import dataclasses

    from proxy.config import Settings
    from trainer import main

    monkeypatch.setenv("ATDP_HOME", str(tmp_path))
    monkeypatch.delenv("ATDP_CONFIG", raising=False)
    for name in [k for k in os.environ if k.startswith("ATDP_TRAIN_")]:
        monkeypatch.delenv(name)
    parser = argparse.ArgumentParser()
    main.register(parser.add_subparsers())
    cfg = main.train_config(parser.parse_args(["train"]), Settings(home=tmp_path))
    plain = TrainConfig(database_url=cfg.database_url, proxy_url=cfg.proxy_url, proxy_key=cfg.proxy_key,
                        checkpoints_dir=cfg.checkpoints_dir)
    from_elsewhere = {"engine_url", "engine_api_key", "weight_transfer", "policies", "gate", "owner"}  # not train_*
    differ = {f.name: (getattr(cfg, f.name), getattr(plain, f.name)) for f in dataclasses.fields(TrainConfig)
              if f.name not in from_elsewhere and getattr(cfg, f.name) != getattr(plain, f.name)}
    assert differ == {}
    assert cfg.train == TrainSettings() and cfg.ppo == PPOOptions() == ppo_options(TrainSettings())
    assert cfg.gate is None
