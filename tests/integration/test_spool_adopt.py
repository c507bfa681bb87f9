"""Spool folders no live process holds are drained by another writer (proxy.record.spool.adopted).

`docker compose up --scale proxy=3` then `--scale proxy=2`: the replica scaled away may have left
records in its spool folder (its database was away when it stopped). Before, they waited for a
process to start and claim that folder, which may never come. Now the writers of the replicas that
remain take each unheld folder a moment, drain it and let it go; a folder a live process holds is
never touched, and a forget purges unheld folders too. Real Recorders, real PostgreSQL; the last
test runs the real `atdp serve` in a subprocess.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import select

from proxy.config import spool_folder, spool_folders
from proxy.governance.policy import TenantPolicy
from proxy.governance.redaction import RedactionConfig, Redactor
from proxy.record.capture import CapturedStep, SessionRef
from proxy.record.recorder import Recorder
from proxy.record.spool import Spool, claim_folder, held
from proxy.store import tables as t
from proxy.store.ids import new_id
from tests.fake_vllm import free_port

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"adopt-secret"


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionConfig(salt=SECRET))


def _step(tenant: str, ext: str, words: str) -> CapturedStep:
    action = {"text": f"ok: {words}", "reasoning": None, "tool_calls": [],
              "output": {"role": "assistant", "content": f"ok: {words}"}}
    return CapturedStep(
        step_id=new_id(), session=SessionRef(tenant=tenant, external_id=ext, source="header"),
        api="chat.completions", started_at=datetime.now(UTC), parent_step_id=None, history_len=0,
        system="You are the build agent.", tools=None, new_messages=[{"role": "user", "content": words}],
        tool_results=[], params={}, action=action, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5],
        output_logprobs=[-0.5, -0.25], finish_reason="stop", status="ok", error=None, upstream=None, model="tiny",
        model_version="v1", ttft_ms=1.0, total_ms=2.0, prompt_tokens=3, completion_tokens=2, transcript_hash=None)


def _recorder(redactor, folder: Path, factory=None, home: Path | None = None) -> Recorder:
    return Recorder(secret=SECRET, factory=factory, spool=Spool(folder), redactor=redactor,
                    policy_for=lambda s, tenant: TenantPolicy(training_consent=True),
                    orphans=partial(spool_folders, home) if home is not None else None, adopt_interval_s=0.0)


def _spool_as_a_stopped_process(redactor, folder: Path, steps: list[CapturedStep]) -> None:
    """A process that held `folder`, spooled `steps` (its database away) and exited."""
    k, fd = claim_folder(lambda _: folder, 0, limit=1)
    gone = _recorder(redactor, folder)
    gone.persist_now(steps)
    assert gone.stats["spooled"] == len(steps) and gone.spool.count() == len(steps)
    gone.spool.close()
    os.close(fd)


def _stored(factory, tenant: str) -> dict[str, str]:
    with factory() as s:
        rows = s.execute(select(t.Step.id, t.Session.external_id).join(t.Session, t.Session.id == t.Step.session_id)
                         .where(t.Step.tenant_id == tenant)).all()
    return {sid: ext for sid, ext in rows}


def test_unheld_folders_are_drained_and_a_held_one_is_left_alone(redactor, factory, tenant, tmp_path):
    home = tmp_path / "home"
    left = [_step(tenant, f"left-{i}", f"task {i}") for i in range(5)]
    _spool_as_a_stopped_process(redactor, spool_folder(home, 1), left)
    live = [_step(tenant, "live", "still running")]
    _spool_as_a_stopped_process(redactor, spool_folder(home, 2), live)
    holder = os.open(spool_folder(home, 2) / ".owner", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # worker 2's process is alive
    assert held(spool_folder(home, 2)) and not held(spool_folder(home, 1))

    rec = _recorder(redactor, spool_folder(home, 0), factory, home)
    rec.drain_spool()
    assert set(_stored(factory, tenant)) == {st.step_id for st in left}
    assert rec.stats["adopted"] == 5
    assert not Spool(spool_folder(home, 1)).pending()  # drained and deleted once written
    assert Spool(spool_folder(home, 2)).count() == 1  # its holder drains it
    assert not held(spool_folder(home, 1))  # let go: a replica starting later may claim it

    os.close(holder)  # that process is gone too
    assert rec.adopt() == 1
    assert set(_stored(factory, tenant)) == {st.step_id for st in left + live}
    rec.spool.close()


def test_a_large_folder_is_drained_a_few_segments_a_look(redactor, factory, tenant, tmp_path, monkeypatch):
    """The writer's own steps are not held behind a large folder: a look writes whole segments up to
    ADOPT_RECORDS and comes back after the writer's next batch for the rest."""
    import proxy.record.recorder as recorder

    home = tmp_path / "home"
    folder = spool_folder(home, 1)
    k, fd = claim_folder(lambda _: folder, 0, limit=1)
    gone = _recorder(redactor, folder)
    steps = [_step(tenant, f"big-{i}", f"turn {i}") for i in range(6)]
    for i in range(0, 6, 2):
        gone.persist_now(steps[i:i + 2])
        gone.spool.close()  # a segment each
    os.close(fd)
    assert len(Spool(folder).segments()) == 3
    monkeypatch.setattr(recorder, "ADOPT_RECORDS", 3)
    rec = _recorder(redactor, spool_folder(home, 0), factory, home)
    rec.adopt_interval_s = 3600.0
    rec.drain_spool()
    assert len(_stored(factory, tenant)) == 4  # two whole segments: the first two did not reach 3
    assert rec._next_adopt == 0.0  # more is left: due again now, not in an hour
    rec.persist_now([_step(tenant, "live", "the writer's own batch")])  # and after it, the rest
    assert len(_stored(factory, tenant)) == 7 and not Spool(folder).pending()
    assert rec._next_adopt > time.monotonic() + 3000
    rec.spool.close()


def test_a_forget_purges_unheld_folders_before_they_are_drained(redactor, factory, tenant, tmp_path):
    home = tmp_path / "home"
    steps = [_step(tenant, "keep", "keep me"), _step(tenant, "forget", "my card is 4111 1111 1111 1111"),
             _step(tenant, "forget", "and again")]
    _spool_as_a_stopped_process(redactor, spool_folder(home, 3), steps)
    rec = _recorder(redactor, spool_folder(home, 0), factory, home)
    rec.forget(tenant, sessions=["forget"])
    left = Spool(spool_folder(home, 3))
    assert left.count() == 1
    assert b"forget" not in b"".join(p.read_bytes() for p in left.segments())
    assert rec.adopt() == 1
    assert _stored(factory, tenant) == {steps[0].step_id: "keep"}
    rec.spool.close()


def test_a_writer_that_holds_no_folder_adopts_none(redactor, factory, tenant, tmp_path):
    """An embedding that did not claim its folder (create_app alone) might share the home with others that
    did not either: it cannot tell a stopped process's folder from a running one's, so it takes none."""
    from proxy.config import Settings
    from proxy.governance.policies import Policies
    from proxy.record.writer_child import build_recorder

    home = tmp_path / "home"
    settings = Settings(home=home, secret=SECRET, database_url="postgresql://unused/db")
    policies = Policies()
    unclaimed = build_recorder(settings, policies, redactor=redactor)
    assert unclaimed.orphans is None
    k, fd = claim_folder(lambda w: spool_folder(home, w), 0)
    try:
        claimed = build_recorder(settings, policies, redactor=redactor)
        spool_folder(home, 1).mkdir(parents=True)
        assert claimed.orphans is not None and claimed.orphans() == [spool_folder(home, 1)]  # not its own
        settings.spool_adopt_s = 0
        assert build_recorder(settings, policies, redactor=redactor).orphans is None
    finally:
        os.close(fd)


def test_atdp_serve_drains_a_stopped_replicas_folder(redactor, db_url, factory, fake_upstream, tmp_path):
    """The real command: its writer child adopts the folder of a replica that stopped with records spooled."""
    home = tmp_path / "home"
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    steps = [_step(tenant, f"s-{i}", f"turn {i}") for i in range(3)]
    _spool_as_a_stopped_process(redactor, spool_folder(home, 1), steps)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATDP_HOME": str(home), "ATDP_OPEN_MODE": "1",
           "ATDP_DEFAULT_TENANT": tenant, "ATDP_UPSTREAM_URL": fake_upstream.url, "ATDP_DATABASE_URL": db_url,
           "ATDP_TOKENIZER": "none", "ATDP_SPOOL_ADOPT_S": "0.5"}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--log-level",
                             "warning"], cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_stored(factory, tenant)) < 3:
            assert proc.poll() is None, "atdp serve exited"
            assert time.monotonic() < deadline, "the stopped replica's records were not written"
            time.sleep(0.2)
        assert held(spool_folder(home, 0))  # the serving process took the first free folder, 0
        assert not Spool(spool_folder(home, 1)).pending()
    finally:
        proc.terminate()
        proc.wait(60)
    assert set(_stored(factory, tenant)) == {st.step_id for st in steps}
