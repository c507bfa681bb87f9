"""One settings model for every process: the documented variable names, the TOML file, the secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.config import Settings, TrainSettings, load_settings, read_settings


def test_variables_keep_their_names_and_meanings(tmp_path):
    s = read_settings({
        "ATDP_HOME": str(tmp_path), "ATDP_UPSTREAM_URL": "http://a:1/, http://b:2", "ATDP_PORT": "9001",
        "ATDP_OPEN_MODE": "true", "ATDP_PRODUCTION": "1", "ATDP_POLICY_FILE": str(tmp_path / "p.toml"),
        "ATDP_WRITER": "THREAD", "ATDP_OTEL_EXPORTER": "Console", "ATDP_MAX_BODY_BYTES": "1024",
        "ATDP_TRAIN_LR": "3e-6", "ATDP_PROXY_URL": "http://proxy:8700", "ATDP_VLLM_PYTHON": "/x/python",
    })
    assert s.home == tmp_path and s.home_given
    assert s.upstream_urls == ["http://a:1", "http://b:2"]
    assert (s.port, s.open_mode, s.production, s.policy_file) == (9001, True, True, tmp_path / "p.toml")
    assert (s.writer_mode, s.otel_exporter, s.max_body_bytes) == ("thread", "console", 1024)
    assert (s.train.lr, s.proxy_url, s.vllm_python) == (3e-6, "http://proxy:8700", "/x/python")


def test_empty_variables_mean_unset_and_defaults_hold():
    s = read_settings({"ATDP_UPSTREAM_URL": "", "ATDP_PORT": "", "ATDP_DATABASE_URL": ""})
    assert s.upstream_urls == ["http://127.0.0.1:8000"] and s.port == 8700 and s.database_url is None
    assert not s.home_given and s.home == Path.home() / ".local" / "share" / "atdp"


def test_the_toml_file_mirrors_the_variables_and_the_environment_wins(tmp_path):
    config = tmp_path / "atdp.toml"
    config.write_text('upstream_url = "http://toml:1"\nport = 9100\nwriter = "thread"\ndefault_tenant = "t"\n')
    s = read_settings({"ATDP_CONFIG": str(config), "ATDP_PORT": "9200"})
    assert s.upstream_urls == ["http://toml:1"] and s.port == 9200 and s.writer_mode == "thread"
    assert s.default_tenant == "t"


def test_bad_values_fail_loudly():
    with pytest.raises(ValidationError):
        read_settings({"ATDP_PORT": "eighty"})


def test_the_trainers_settings_are_one_section_under_their_flat_names(tmp_path):
    """ATDP_TRAIN_<NAME>, and train_<name> in the TOML file (or <name> in its [train] table), are
    settings.train.<name>: the environment over the file, a flat key over the table. Other
    ATDP_TRAIN_* variables (docker-compose's ATDP_TRAIN_NPROC) are not settings and stay ignored."""
    config = tmp_path / "atdp.toml"
    config.write_text('train_lr = 2e-5\ntrain_samples = "step"\ntrain_seed = 3\n'
                      '[train]\nmax_steps = 64\nseed = 9\nkl_ref = "base"\n')
    s = read_settings({"ATDP_CONFIG": str(config), "ATDP_TRAIN_SEED": "5", "ATDP_TRAIN_KL_COEF": "0.1",
                       "ATDP_TRAIN_NPROC": "4", "ATDP_TRAIN_MAX_LEN": ""})
    assert s.train == TrainSettings(lr=2e-5, samples="step", max_steps=64, seed=5, kl_ref="base", kl_coef=0.1)
    assert s.train.max_len == 4096  # empty: the default
    assert read_settings({}).train == TrainSettings() and Settings().train == TrainSettings()
    assert read_settings({"ATDP_TRAIN_LR": "3e-5"}).train.lr == 3e-5
    with pytest.raises(ValidationError):
        s.train.lr = 1.0  # frozen: the flags make a new one (trainer.main.train_settings)


def test_a_bad_trainer_setting_is_refused_under_its_own_name(tmp_path):
    with pytest.raises(ValidationError, match=r"ATDP_TRAIN_LR \(train_lr\): Input should be a valid number"):
        read_settings({"ATDP_TRAIN_LR": "fast"})
    config = tmp_path / "atdp.toml"
    config.write_text('train_samples = "concat"\n')
    with pytest.raises(ValidationError, match=r"ATDP_TRAIN_SAMPLES \(train_samples\): Input should be 'step' or"):
        read_settings({"ATDP_CONFIG": str(config)})
    config.write_text('[train]\nlearning_rate = 1e-5\n')
    with pytest.raises(ValidationError, match=r"\[train\] learning_rate: not a trainer setting"):
        read_settings({"ATDP_CONFIG": str(config)})


def test_the_secret_is_created_once_per_home(tmp_path):
    first = load_settings({"ATDP_HOME": str(tmp_path)}).secret
    assert first and (tmp_path / "secret").read_bytes().strip() == first
    assert load_settings({"ATDP_HOME": str(tmp_path)}).secret == first
    assert load_settings({"ATDP_HOME": str(tmp_path), "ATDP_SECRET": "given"}).secret == b"given"


def test_constructed_settings_take_field_names():
    s = Settings(home=Path("/h"), upstream_urls=["http://x/"], writer_mode="thread", secret=b"s")
    assert s.upstream_urls == ["http://x"] and s.writer_mode == "thread" and s.spool_dir == Path("/h/spool")


def test_replicas_starting_together_share_one_secret_and_one_admin_key(tmp_path):
    """The replicas of `docker compose up --scale proxy=3` start at once on one volume, each as its
    container's pid 1. Threads of one process share a pid too: the admin key's temporary file was
    named by pid, so one replica removed another's (FileNotFoundError, the replica restarting), and
    the secret was created empty first, then written, so a replica could read it empty."""
    import threading

    from proxy import config

    n = 16
    ready = threading.Barrier(n)
    got: list[tuple[bytes, str]] = []
    errors: list[BaseException] = []

    def start() -> None:
        ready.wait()
        try:
            got.append((config._load_secret(tmp_path / "home"), config._admin_key_from(tmp_path / "home" / "admin-key")))
        except BaseException as e:  # noqa: BLE001 - every failure is the finding
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(got) == n and len(set(got)) == 1
    secret, key = got[0]
    assert len(secret) == 64 and len(key) >= 40
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["admin-key", "secret"]  # no leftovers
