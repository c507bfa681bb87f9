"""The trainer's bookkeeping against PostgreSQL and the proxy (scripted upstream, tiny trainer model).

Leases are exclusive (SKIP LOCKED) and expire; rewards come from step or session feedback through
the tenant's combine rule; stale steps are marked; one `--once` update writes a checkpoint, a version
with its lineage, and swaps it in; a failed swap releases the steps and keeps the lineage.
"""

from __future__ import annotations

import math
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.config import TrainSettings
from proxy.governance.policies import Policies
from proxy.store import tables as t
from tests.proxy_fixtures import all_trainable
from trainer import lease
from trainer.loop import TrainConfig, run

ADMIN = {"authorization": "Bearer admin-test-key"}




def _serving(factory, name: str, checkpoint: str, *, age_s: float = 0.0) -> str:
    vid = str(uuid.uuid4())
    when = datetime.now(UTC) - timedelta(seconds=age_s)
    with factory() as s, s.begin():
        for row in s.scalars(select(t.ModelVersion).where(t.ModelVersion.status == "serving")):
            row.status = "retired"
        s.add(t.ModelVersion(id=vid, name=name, checkpoint=checkpoint, status="serving", served_at=when,
                             created_at=when, metrics={}))
    return vid


def _proxy(start_proxy, fake_upstream, url, factory, tiny_dir):
    _serving(factory, "base", str(tiny_dir), age_s=60)
    proxy = start_proxy([fake_upstream.url], database_url=url)
    assert proxy.versions.ready.wait(30)
    return proxy


def _session(proxy, sid: str, turns: list[str], *, task: str | None = None) -> None:
    c = openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0)
    headers = {"x-atdp-session-id": sid, **({"x-atdp-task-id": task} if task else {})}
    messages = []
    for text in turns:
        messages.append({"role": "user", "content": f"#say {text}"})
        r = c.chat.completions.create(model="fake", messages=messages, extra_headers=headers, logprobs=True)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    proxy.flush()  # the writer is asynchronous: feedback needs the session stored


def _feedback(proxy, sid: str, **body) -> None:
    r = httpx.post(f"{proxy.url}/atdp/v1/sessions/{sid}/feedback", json=body, timeout=10)
    assert r.status_code == 200, r.text


def test_leases_are_exclusive_and_expire(start_proxy, fake_upstream, own_db, tiny_dir):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    for k in range(6):
        _session(proxy, f"s{k}", ["aa", "bb"])
        _feedback(proxy, f"s{k}", reward=float(k % 2))
    _session(proxy, "unrewarded", ["cc"])
    proxy.flush()
    with factory() as s:
        assert lease.count_ready(s) == 12  # 6 sessions x 2 steps; the unrewarded one is not ready

    # Two trainers at once: the second skips the rows the first has locked.
    a, b = factory(), factory()
    with a.begin(), b.begin():
        got_a = lease.lease(a, owner="A", ttl_s=60, max_steps=5)
        got_b = lease.lease(b, owner="B", ttl_s=60, max_steps=100)
    assert len(got_a) == 5 and len(got_b) == 7 and not set(got_a) & set(got_b)
    a.close()
    b.close()
    with factory() as s, s.begin():
        assert lease.lease(s, owner="C", ttl_s=60, max_steps=100) == []  # all held
        assert lease.count_ready(s) == 0
        # A crashed: its lease runs out (expires in the past) and C gets its steps.
        s.execute(t.Step.__table__.update().where(t.Step.lease_owner == "A")
                  .values(lease_expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    with factory() as s, s.begin():
        assert sorted(lease.lease(s, owner="C", ttl_s=60, max_steps=100)) == sorted(got_a)
        lease.release(s, got_b, owner="not-B")  # only the owner releases
    with factory() as s:
        assert {st.lease_owner for st in s.scalars(select(t.Step).where(t.Step.id.in_(got_b)))} == {"B"}


def test_rewards_lag_and_stale_marking(start_proxy, fake_upstream, own_db, tiny_dir):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    _session(proxy, "multi", ["one", "two"])
    _feedback(proxy, "multi", reward=0.2)
    _feedback(proxy, "multi", reward=0.6)  # reward_combine "last" by default: 0.6
    steps = proxy.steps(factory, "multi")
    _feedback(proxy, "multi", reward=-1.0, step_id=steps[0].id)  # a step-level reward wins for that step
    proxy.flush()
    with factory() as s, s.begin():
        ids = lease.lease(s, owner="T", ttl_s=60, max_steps=10)
        loaded = lease.load(s, ids, current="base", policies=Policies())
    by_id = {st.step_id: st for st in loaded.steps}
    assert by_id[steps[0].id].reward == -1.0 and by_id[steps[1].id].reward == 0.6
    second = by_id[steps[1].id]
    # the prompt rebuilt from the stored suffix equals what the engine saw: prior turn + output + new turn
    first = by_id[steps[0].id]
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    assert second.output_ids == list(b"[w0] two") and second.output_versions == ["base"] * 8
    assert all(st.version_lag == 0 for st in loaded.steps)
    assert {st.tenant_id for st in loaded.steps} == {proxy.tenant}  # advantage groups are per tenant

    # Two more versions serve since: the steps are 2 versions behind.
    _serving(factory, "v1", "/x/v1", age_s=30)
    _serving(factory, "v2", "/x/v2")
    with factory() as s:
        ranks = lease.version_ranks(s)
    assert ranks == {"base": 0, "v1": 1, "v2": 2}
    assert lease.version_lag(["base", "v1"], ranks, "v2") == 2
    assert lease.version_lag(["v2"], ranks, "v2") == 0
    assert lease.version_lag(["nope"], ranks, "v2") == lease.UNKNOWN_LAG

    cfg = TrainConfig(database_url=url, proxy_url=proxy.url, proxy_key="admin-test-key",
                      checkpoints_dir=Path("/nonexistent"), once=True,
                      train=TrainSettings(max_version_lag=1, lease_ttl_s=0.0), policies=all_trainable())
    time.sleep(0.05)  # T's lease (ttl 60) is still live: release it first
    with factory() as s, s.begin():
        lease.release(s, ids, owner="T")
    from trainer.loop import Controller

    ctl = Controller(cfg)
    try:
        plan = ctl.next_plan()
    finally:
        ctl.engine.dispose()
    assert plan.kind == "wait" and plan.n_stale == 2
    with factory() as s:
        rows = s.scalars(select(t.Step).where(t.Step.id.in_(ids))).all()
        assert {r.skipped_reason for r in rows} == {"stale: 2 versions behind v2 (max 1)"}
        assert all(r.lease_owner is None for r in rows)
        assert lease.count_ready(s) == 0


def _trainer_key(url: str) -> str:
    """A key scoped to versions:write, what `atdp train` registers versions with (not the admin key)."""
    from proxy.auth import create_key
    from proxy.store import db

    engine = db.make_engine(url)
    try:
        with db.transaction(db.session_factory(engine)) as s:
            return create_key(s, "trainer", name="trainer", scopes=["versions:write"])[1]
    finally:
        engine.dispose()


def _cfg(url, proxy, home: Path, **settings) -> TrainConfig:
    # ratio masks off: the fake's logprobs are made up
    train = TrainSettings(**{"lr": 1e-3, "ratio_mask_low": 0.0, "ratio_mask_high": float("inf"), **settings})
    return TrainConfig(database_url=url, proxy_url=proxy.url, proxy_key=_trainer_key(url),
                       checkpoints_dir=home / "checkpoints", once=True, train=train, policies=all_trainable())


def test_once_trains_registers_lineage_and_swaps(start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    for k in range(4):
        _session(proxy, f"s{k}", ["first", "second"], task="greet")
        _feedback(proxy, f"s{k}", reward=k / 3)
    proxy.flush()

    (result,) = run(_cfg(url, proxy, tmp_path))
    assert result.status == "serving" and result.version == "v1"
    m = result.metrics
    assert m["steps"] == 8 and m["samples"] == 4 and m["reward_mean"] == pytest.approx(0.5)
    ckpt = Path(m["checkpoint"])
    assert (ckpt / "model.safetensors").exists() and ckpt.parent == tmp_path / "checkpoints"
    assert fake_upstream.weights == "v1" and fake_upstream.version == "v1"

    with factory() as s:
        v = s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == "v1")).one()
        assert v.status == "serving" and v.checkpoint == str(ckpt) and v.training_run_id
        base = s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == "base")).one()
        assert v.parent_id == base.id and base.status == "retired"
        lineage = s.scalars(select(t.VersionLineage).where(t.VersionLineage.version_id == v.id)).all()
        steps = s.scalars(select(t.Step).where(t.Step.tenant_id == proxy.tenant)).all()
        assert {x.step_id for x in lineage} == {st.id for st in steps}
        # group baseline (4 sessions share task "greet"), normalised by the group's std
        adv = {x.session_id: (x.reward, x.advantage) for x in lineage}
        assert sorted(r for r, _ in adv.values()) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
        assert sum(a for _, a in adv.values()) == pytest.approx(0.0, abs=1e-5)
        assert all(st.trained_version_id == v.id and st.lease_owner is None for st in steps)
        run_row = s.get(t.TrainingRun, v.training_run_id)
        assert run_row.status == "finished" and run_row.ended_at is not None
        assert run_row.config["train"]["lr"] == 1e-3 and run_row.config["once"] is True
        (upd,) = s.scalars(select(t.TrainingUpdate).where(t.TrainingUpdate.run_id == run_row.id)).all()
        for key in ("reward_mean", "reward_std", "loss", "clip_frac", "masked_frac", "mean_abs_logp_diff",
                    "tokens_per_s"):
            assert key in upd.metrics
        assert upd.version_id == v.id and upd.metrics["swap_status"] == "serving"

    # Traffic after the swap is stamped with the new version.
    _session(proxy, "after", ["x"])
    (st,) = proxy.steps(factory, "after")
    assert st.model_version == "v1" and bytes(st.output_token_ids).startswith(b"[v1] ")

    # Nothing left: --once trains nothing and says so.
    assert run(_cfg(url, proxy, tmp_path)) == []


def _rewarded_sessions(proxy, prefix: str, n: int, *, task: str | None = None) -> None:
    for k in range(n):
        _session(proxy, f"{prefix}{k}", ["hello"], task=task)
        _feedback(proxy, f"{prefix}{k}", reward=k / 2)
    proxy.flush()


def _failed_with_steps_released(factory, proxy, name: str, n_steps: int) -> str:
    """The version's error, after checking it failed, kept its lineage, and gave its steps back."""
    with factory() as s:
        v = s.scalars(select(t.ModelVersion).where(t.ModelVersion.name == name)).one()
        assert v.status == "failed" and v.error
        assert len(s.scalars(select(t.VersionLineage).where(t.VersionLineage.version_id == v.id)).all()) == n_steps
        assert lease.count_ready(s) == n_steps  # released: a later update trains on them
        assert s.scalars(select(t.ModelVersion.name).where(t.ModelVersion.status == "serving")).one() == "base"
    assert [r.version for r in proxy.state.pool.replicas] == ["base"]
    return v.error


def test_failed_swap_releases_steps_and_keeps_lineage(start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    _rewarded_sessions(proxy, "f", 3)
    fake_upstream.fail_reload = True
    (result,) = run(_cfg(url, proxy, tmp_path))
    assert result.status == "failed" and "reload" in result.metrics["swap_error"]
    _failed_with_steps_released(factory, proxy, result.version, 3)

    fake_upstream.fail_reload = False
    (again,) = run(_cfg(url, proxy, tmp_path))
    assert again.status == "serving" and again.version != result.version


def test_non_finite_update_is_refused_marked_failed_and_releases_steps(start_proxy, fake_upstream, own_db, tiny_dir,
                                                                       tmp_path):
    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    _rewarded_sessions(proxy, "n", 3)
    # An infinite step size: every weight becomes inf or NaN after the optimizer step.
    (result,) = run(_cfg(url, proxy, tmp_path, lr=float("inf")))
    assert result.status == "failed" and "non-finite weights" in result.metrics["swap_error"]
    assert not Path(result.metrics["checkpoint"]).exists()  # never written, never offered to the engine
    assert fake_upstream.weights != result.version
    assert "not published" in _failed_with_steps_released(factory, proxy, result.version, 3)

    (again,) = run(_cfg(url, proxy, tmp_path))
    assert again.status == "serving" and again.metrics["steps"] == 3


def test_optimizer_state_resumes_across_once_runs_and_kl_to_base(start_proxy, fake_upstream, own_db, tiny_dir,
                                                                  tmp_path):
    import torch

    from trainer.checkpoint import trainer_state_path

    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    for round_ in range(2):
        _rewarded_sessions(proxy, f"r{round_}-", 3, task="t")
        kw = {"kl_coef": 0.1, "kl_ref": "base"} if round_ else {}
        (result,) = run(_cfg(url, proxy, tmp_path, optimizer_state="keep", **kw))
        m = result.metrics
        assert result.status == "serving" and m["optimizer_resumed"] is bool(round_)
        assert m["exact_steps"] == 3 and m["onpolicy_steps"] == 0
        # logged KL: to the fake engine's made-up logprobs in round 0, to base (close to v1) in round 1
        assert math.isfinite(m["kl"]) and (0 < m["kl"] < 1) is bool(round_)
        saved = torch.load(trainer_state_path(tmp_path / "checkpoints"), weights_only=True)
        assert (saved["version"], saved["checkpoint"]) == (result.version, m["checkpoint"])
        assert not any(p.name.endswith(".pt") for p in Path(m["checkpoint"]).iterdir())  # the served folder stays HF


def test_fresh_optimizer_state_is_neither_saved_nor_resumed(start_proxy, fake_upstream, own_db, tiny_dir, tmp_path):
    from trainer.checkpoint import trainer_state_path

    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    for round_ in range(2):
        _rewarded_sessions(proxy, f"f{round_}-", 3, task="t")
        (result,) = run(_cfg(url, proxy, tmp_path, optimizer_state="fresh"))
        assert result.status == "serving" and result.metrics["optimizer_resumed"] is False
    assert not trainer_state_path(tmp_path / "checkpoints").exists()


def test_complete_checks_the_lease_owner(start_proxy, fake_upstream, own_db, tiny_dir):
    """Another trainer's lease, or this trainer's expired one, cannot be completed (#13)."""
    from trainer import swap

    url, factory = own_db
    proxy = _proxy(start_proxy, fake_upstream, url, factory, tiny_dir)
    _session(proxy, "owned", ["aa", "bb"])
    _feedback(proxy, "owned", reward=1.0)
    with factory() as s, s.begin():
        ids = lease.lease(s, owner="A", ttl_s=60, max_steps=10)
        sessions = dict(s.execute(select(t.Step.id, t.Step.session_id).where(t.Step.id.in_(ids))).all())
    assert len(ids) == 2
    rows = [lease.LineageRow(step_id=i, session_id=sessions[i], reward=1.0, advantage=0.5) for i in ids]

    def register(owner: str) -> str:
        return swap.register_candidate(factory, name=f"v-{uuid.uuid4().hex[:6]}", checkpoint=str(tiny_dir),
                                       parent_id=None, run_id=None, lineage=rows, owner=owner, metrics={})[0]

    def trained() -> set[str | None]:
        with factory() as s:
            return set(s.scalars(select(t.Step.trained_version_id).where(t.Step.id.in_(ids))))

    with pytest.raises(lease.LeaseLost):
        register("B")  # not B's steps
    assert trained() == {None}
    with factory() as s, s.begin():  # A's lease runs out
        s.execute(t.Step.__table__.update().where(t.Step.id.in_(ids))
                  .values(lease_expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    with pytest.raises(lease.LeaseLost):
        register("A")
    with factory() as s:  # nothing of the refused candidates stayed: no lineage, no version rows
        assert s.scalar(select(t.VersionLineage.step_id).where(t.VersionLineage.step_id.in_(ids))) is None
        assert s.scalar(select(t.ModelVersion.id).where(t.ModelVersion.status == "candidate")) is None
    with factory() as s, s.begin():
        assert sorted(lease.lease(s, owner="A", ttl_s=60, max_steps=10)) == sorted(ids)
    version_id = register("A")
    assert trained() == {version_id}
