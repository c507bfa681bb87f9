"""A forget racing the writer (proxy.store.forgets): what a batch refers to is stored when it lands.

The writer refers to a content it believes stored instead of writing it again. Two sessions share a
system prompt; one is forgotten, and the prompt, which no stored step of the other refers to yet,
goes with it. A batch of the other session prepared before the forget's note reached the writer
refers to the prompt. Before the forget count, it was written referring to a row that is gone.
Real Preparer and Recorder with a real Redactor, real PostgreSQL.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text

from proxy.governance.forget import forget_session, forget_tenant
from proxy.governance.policy import TenantPolicy
from proxy.governance.redaction import RedactionConfig, Redactor
from proxy.lru import content_key
from proxy.record.capture import CapturedStep, SessionRef
from proxy.record.recorder import Recorder
from proxy.record.spool import Spool
from proxy.store import db
from proxy.store import tables as t
from proxy.store.content import content_hash
from proxy.store.forgets import STALE_REASON, counts
from proxy.store.ids import new_id
from proxy.store.read import session_document
from proxy.store.write import write_steps

SECRET = b"race-secret"
SYSTEM = "You are the release agent of the payments team. Answer in one line."


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionConfig(salt=b"race-salt"))


@pytest.fixture
def recorder(factory, redactor, tmp_path):
    rec = Recorder(secret=SECRET, factory=factory, spool=Spool(tmp_path / "spool"), redactor=redactor,
                   policy_for=lambda s, tenant: TenantPolicy(training_consent=True))
    yield rec
    rec.spool.close()


def _step(tenant: str, ext: str, words: str, *, at: datetime | None = None, system: str = SYSTEM) -> CapturedStep:
    action = {"text": f"done: {words}", "reasoning": None, "tool_calls": [],
              "output": {"role": "assistant", "content": f"done: {words}"}}
    return CapturedStep(
        step_id=new_id(), session=SessionRef(tenant=tenant, external_id=ext, source="header"),
        api="chat.completions", started_at=at or datetime.now(UTC), parent_step_id=None, history_len=0,
        system=system, tools=None, new_messages=[{"role": "user", "content": words}], tool_results=[], params={},
        action=action, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5], output_logprobs=[-0.5, -0.25],
        finish_reason="stop", status="ok", error=None, upstream=None, model="tiny", model_version="v1",
        ttft_ms=1.0, total_ms=2.0, prompt_tokens=3, completion_tokens=2, transcript_hash=None)


def _system_stored(factory, tenant: str) -> bool:
    with factory() as s:
        return s.get(t.Content, (tenant, content_hash(SECRET, SYSTEM))) is not None


def _forget_behind_the_writers_back(factory, tenant: str, ext: str) -> int:
    """Forget a session as another proxy would: this writer has not heard of it (its note is on the way)."""
    with db.transaction(factory) as s:
        out = forget_session(s, ext, tenant=tenant, actor="test")
    return out.forgets


def test_a_batch_prepared_before_a_forgets_note_carries_the_contents_the_forget_deleted(factory, recorder, tenant):
    recorder.persist_now([_step(tenant, "gone", "deploy the hotfix")])
    assert _system_stored(factory, tenant)
    assert _forget_behind_the_writers_back(factory, tenant, "gone") == 1
    assert not _system_stored(factory, tenant)  # only the forgotten session referred to it
    # The writer still believes the prompt stored: its next batch refers to it and does not carry it.
    assert content_key(tenant, content_hash(SECRET, SYSTEM)) in recorder.preparer._known

    late = _step(tenant, "kept", "roll back the canary")
    recorder.persist_now([late])

    assert recorder.stats["reprepared"] == 1 and recorder.stats["written"] == 2
    assert _system_stored(factory, tenant)
    with factory() as s:
        step = t.get_step(s, late.step_id)
        doc = session_document(s, s.get(t.Session, step.session_id))
    assert step.eligibility == "eligible"
    assert doc.steps[0].observation.system.content == SYSTEM
    assert doc.steps[0].observation.messages[0].content == {"role": "user", "content": "roll back the canary"}


def test_a_writer_that_heard_the_forget_checks_nothing(factory, recorder, tenant):
    """The forget's count reaches the writer with its note: from then on its batches are not checked."""
    recorder.persist_now([_step(tenant, "gone", "tag the release")])
    with db.transaction(factory) as s:
        out = forget_session(s, "gone", tenant=tenant, actor="test")
    recorder.forget(tenant, step_ids=out.step_ids, content_hashes=out.content_hashes, forgets=[out.forgets])
    assert recorder.preparer.seen([tenant]) == {tenant: 1}
    recorder.persist_now([_step(tenant, "kept", "write the notes")])
    assert recorder.stats.get("reprepared", 0) == 0  # the note had dropped the prompt: carried, not referred to
    assert _system_stored(factory, tenant)


def test_a_spooled_step_whose_contents_were_forgotten_is_kept_quarantined(factory, recorder, tenant):
    """A record prepared long ago (the spool, a dead letter) cannot be prepared again: its text is
    gone, so it is kept, quarantined (never trained on), and the rest of its batch is written as is."""
    recorder.persist_now([_step(tenant, "gone", "rotate the keys")])
    spooled = recorder.prepare([_step(tenant, "kept", "rotate them again"),
                                _step(tenant, "other", "an unrelated question", system="Answer briefly.")])
    _forget_behind_the_writers_back(factory, tenant, "gone")
    with db.transaction(factory) as s:
        assert write_steps(s, spooled, new_id) == 2  # no `seen`: every reference is checked
    with factory() as s:
        kept = t.get_step(s, spooled[0].id)
        other = t.get_step(s, spooled[1].id)
    assert (kept.eligibility, kept.eligibility_reason) == ("quarantined", STALE_REASON)
    assert other.eligibility == "eligible"  # what it refers to it carries


def test_a_write_waits_for_a_forget_of_its_tenant_and_then_honours_it(factory, recorder, tenant):
    """A forget and a write of one tenant do not overlap. Before the locks, a late step of the session
    (started before the forget) passed the tombstone check, which could not see the forget's
    uncommitted tombstone, and came back as a new session once the forget committed."""
    # Another session said the same: the forget deletes no content, so it counts nothing (its count's
    # row lock would serialise the two as well, but only from its end).
    recorder.persist_now([_step(tenant, "gone", "open the incident"), _step(tenant, "twin", "open the incident")])
    late = recorder.prepare([_step(tenant, "gone", "close the incident", at=datetime.now(UTC) - timedelta(seconds=1))])
    forgetting = factory()
    forgetting.begin()
    assert forget_session(forgetting, "gone", tenant=tenant, actor="test").forgets is None  # not committed

    done: list[int] = []
    writer = threading.Thread(target=lambda: done.append(_write(factory, late)))
    writer.start()
    time.sleep(0.5)
    with factory() as s:
        waiting = s.scalar(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"))
    assert not done and waiting == 1  # the write waits on the tenant's lock
    forgetting.commit()
    forgetting.close()
    writer.join(10)
    assert done == [0]  # the tombstone, committed, refused the late step
    with factory() as s:
        names = s.scalars(select(t.Session.external_id).where(t.Session.tenant_id == tenant)).all()
    assert names == ["twin"]


def _write(factory, records) -> int:
    with db.transaction(factory) as s:
        return write_steps(s, records, new_id)


def test_forgets_are_counted_per_tenant_and_only_when_they_delete_contents(factory, recorder, tenant):
    other = f"{tenant}-b"
    recorder.persist_now([_step(tenant, "a", "one"), _step(tenant, "b", "two"), _step(other, "c", "three")])
    with db.transaction(factory) as s:
        assert forget_session(s, "a", tenant=tenant, actor="test").forgets == 1  # its message and answer went
        assert forget_tenant(s, other, actor="test").forgets == 1
    with factory() as s:
        assert counts(s, [tenant, other, "nobody"]) == {tenant: 1, other: 1}
    # A session whose every content another session shares deletes none: nothing to count.
    recorder.persist_now([_step(tenant, "d", "two")])
    with db.transaction(factory) as s:
        assert forget_session(s, "d", tenant=tenant, actor="test").forgets is None
