"""`atdp train --when diagnosed`: the trainer (tiny model, real PostgreSQL, proxy + scripted upstream)
does not update while the diagnosis recommends only the harness, and does once a policy finding exists."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from proxy.config import Settings, TrainSettings
from proxy.evolve.diagnose import diagnose
from proxy.evolve.rules import Rules
from proxy.store import db
from proxy.store import tables as t
from tests.diagnosis_seed import chat_session, seed_harness, seed_policy, tenant_key
from tests.proxy_fixtures import all_trainable
from trainer import lease
from trainer.gate import DiagnosisGate
from trainer.loop import TrainConfig, run
from trainer.main import diagnosis_gate


def _cfg(url: str, proxy, home: Path, gate: DiagnosisGate | None) -> TrainConfig:
    # ratio masks off: the fake's logprobs are made up
    train = TrainSettings(lr=1e-3, ratio_mask_low=0.0, ratio_mask_high=float("inf"))
    return TrainConfig(database_url=url, proxy_url=proxy.url, proxy_key="admin-test-key",
                       checkpoints_dir=home / "checkpoints", once=True, train=train, gate=gate,
                       policies=all_trainable())


def test_train_when_diagnosed_waits_for_a_policy_finding(new_database, start_proxy, fake_upstream, tiny_dir, tmp_path):
    url = new_database("atdp_gate")
    db.upgrade(url)
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    when = datetime.now(UTC) - timedelta(seconds=60)
    with factory() as s, s.begin():
        s.add(t.ModelVersion(id=str(uuid.uuid4()), name="base", checkpoint=str(tiny_dir), status="serving",
                             served_at=when, created_at=when, metrics={}))
    proxy = start_proxy([fake_upstream.url], database_url=url)
    assert proxy.versions.ready.wait(30)
    key = tenant_key(factory, f"t-{uuid.uuid4().hex[:8]}")

    # Only a harness problem (one tool fails everywhere): rewarded steps wait, nothing is trained.
    seed_harness(proxy, other_key=key, n=3)
    proxy.flush()
    with factory() as s:
        ready = lease.count_ready(s)
    assert ready > 0
    assert run(_cfg(url, proxy, tmp_path, DiagnosisGate(Rules()))) == []
    with factory() as s:
        assert DiagnosisGate(Rules())(s) == "diagnosis recommends no policy update (top layer: harness)"
        assert lease.count_ready(s) == ready
        assert s.scalars(select(t.ModelVersion.name)).all() == ["base"]

    # Failures spread across tenants, tasks and tools: a policy finding, so the trainer updates.
    seed_policy(proxy, other_key=key, n=6)
    proxy.flush()
    with factory() as s:
        assert DiagnosisGate(Rules())(s) is None
    (result,) = run(_cfg(url, proxy, tmp_path, DiagnosisGate(Rules())))
    assert result.status == "serving" and result.version == "v1"
    with factory() as s:
        assert lease.count_ready(s) == 0

    # After v1, traffic moves to a task its training data never had: drift against v1's training window.
    for k in range(6):
        chat_session(proxy, f"summary {k}", task="summarise")
    proxy.flush()
    with factory() as s:
        d = diagnose(s, Rules(min_drift_steps=5))
    (drift,) = [f for f in d.findings if f.kind == "drift"]
    dims = drift.evidence["dimensions"]
    assert drift.layer == "policy" and drift.evidence["version"] == "v1" and drift.evidence["recent_steps"] == 6
    assert dims["task"]["tvd"] == 1.0 and dims["task"]["psi"] > 1
    # v1 trained on tool sessions (two tool calls and an answer each); the new traffic calls no tool.
    assert dims["tool"]["tvd"] == pytest.approx(2 / 3, abs=1e-3)
    engine.dispose()


def test_when_flag_builds_the_gate_from_the_settings(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text("[diagnosis]\nmin_failures = 7\n")
    settings = Settings(home=tmp_path, diagnosis_file=rules)
    assert diagnosis_gate("always", settings) is None
    gate = diagnosis_gate("diagnosed", settings)
    assert gate is not None and gate.rules.min_failures == 7
    with pytest.raises(SystemExit, match="--when must be one of always, diagnosed"):
        diagnosis_gate("sometimes", settings)
    rules.write_text("min_failures = -1\n")
    with pytest.raises(SystemExit, match="min_failures must not be negative"):
        diagnosis_gate("diagnosed", settings)
    # The flag, as `atdp train` parses it (default: always, as before).
    from proxy.cli import build_parser

    assert build_parser().parse_args(["train", "--when", "diagnosed"]).when == "diagnosed"
    assert build_parser().parse_args(["train"]).when == "always"
