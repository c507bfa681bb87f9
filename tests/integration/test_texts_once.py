"""Long texts stored once (proxy/store/texts.py, migration 0013): a tool result and a model's text are
one row each, however many envelopes carry them, and every reader gets the bodies back as sent.
Real Preparer with a real Redactor, real PostgreSQL."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, select, text

from proxy.governance.forget import forget_session
from proxy.governance.policy import TenantPolicy
from proxy.governance.redaction import RedactionConfig, Redactor
from proxy.record.capture import CapturedStep, SessionRef, ToolResultIn
from proxy.record.prepare import Preparer
from proxy.store import db
from proxy.store import tables as t
from proxy.store.ids import new_id
from proxy.store.read import load_contents, session_document
from proxy.store.texts import MARK, REF
from proxy.store.write import write_steps

THOUGHT = "I will read the parser module first, then run the failing test to see the traceback. " * 4
RESULT = "def parse(line):\n    head, _, tail = line.partition('=')\n    return head.strip(), tail.strip()\n" * 5
EMAIL = "maria.gonzalez@fastmail.com"
PII_RESULT = f"Owner of the repository: {EMAIL}. " + "The build log shows no failures in any module. " * 8


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionConfig(salt=b"test-salt"))


ANSWER = "The parser splits on the first equals sign; the test expects the last one. " * 4


def _turns(tenant: str, ext: str, result: str, task: str = "Fix the parser.", answer: str = ANSWER
           ) -> list[CapturedStep]:
    """Two calls of an agent: a tool call with a long thought, then its long result and the next answer."""
    native = {"role": "assistant", "content": THOUGHT,
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "read_file", "arguments": '{"path": "parser.py"}'}}]}
    action1 = {"text": THOUGHT, "reasoning": None, "output": native,
               "tool_calls": [{"id": "call_1", "name": "read_file", "arguments": '{"path": "parser.py"}'}]}
    action2 = {"text": answer, "reasoning": ext, "tool_calls": [], "output": {"role": "assistant", "content": answer}}
    now = datetime.now(UTC)
    first = new_id()

    def step(step_id, parent, messages, results, action, history, at):
        return CapturedStep(
            step_id=step_id, session=SessionRef(tenant=tenant, external_id=ext, source="header"),
            api="chat.completions", started_at=at, parent_step_id=parent, history_len=history, system="be brief",
            tools=None, new_messages=messages, tool_results=results, params={}, action=action,
            prompt_token_ids=[], output_token_ids=[], output_logprobs=[],
            finish_reason="stop", status="ok", error=None, upstream=None, model="tiny", model_version="v1",
            ttft_ms=1.0, total_ms=2.0, prompt_tokens=0, completion_tokens=0, transcript_hash=None)

    user = {"role": "user", "content": task}
    tool_msg = {"role": "tool", "tool_call_id": "call_1", "content": result}
    return [step(first, None, [{"role": "system", "content": "be brief"}, user], [], action1, 0, now),
            step(new_id(), first, [native, tool_msg], [ToolResultIn(call_id="call_1", content=result)], action2, 2,
                 now + timedelta(seconds=1))]


def _write(factory, redactor, steps):
    prep = Preparer(secret=b"texts-secret", redactor=redactor, database=lambda: factory,
                    policy_for=lambda s, tenant: TenantPolicy(training_consent=True))
    records = prep.prepare(steps)
    with db.transaction(factory) as s:
        assert write_steps(s, records, new_id) == len(records)
    return records


def _rows_holding(s, tenant: str, needle: str) -> int:
    return s.scalar(text("SELECT count(*) FROM contents WHERE tenant_id = :t AND strpos(body::text, :n) > 0"),
                    {"t": tenant, "n": needle})


def test_each_long_text_is_one_row_and_reads_back(factory, tenant, redactor):
    steps = _turns(tenant, "s-once", RESULT)
    first, second = _write(factory, redactor, steps)
    with factory() as s:
        # The output's native message is the row the agent's echo of it (next call) refers to.
        output = s.scalar(select(t.Content.body).where(t.Content.tenant_id == tenant, t.Content.hash == first.output_hash))
        assert output["output"] == REF + second.message_hashes[0]
        # The thought was in the action twice and in the echoed message; the result in its own content
        # and in the tool message: one row each now.
        assert _rows_holding(s, tenant, THOUGHT[:80]) == 1
        assert _rows_holding(s, tenant, RESULT[:60].replace("\n", "\\n")) == 1
        session = s.scalar(select(t.Session).where(t.Session.tenant_id == tenant, t.Session.external_id == "s-once"))
        doc = session_document(s, session)
        view = s.execute(text("SELECT seq, assistant_text, tool_call_names FROM atdp_steps_readable "
                              "WHERE session_internal_id = :i ORDER BY seq"), {"i": session.id}).all()
    one, two = doc.steps
    assert one.action.text == THOUGHT and one.action.output == steps[0].action["output"]
    assert [m.content for m in two.observation.messages] == steps[1].new_messages
    assert two.observation.tool_results[0].content == RESULT
    assert one.observation.system.content == "be brief"
    assert view[0] == (1, THOUGHT, ["read_file"])
    assert view[1][1] == steps[1].action["text"]


def test_redacted_text_reads_redacted_everywhere(factory, tenant, redactor):
    _write(factory, redactor, _turns(tenant, "s-pii", PII_RESULT))
    with factory() as s:
        assert _rows_holding(s, tenant, EMAIL) == 0
        session = s.scalar(select(t.Session).where(t.Session.tenant_id == tenant, t.Session.external_id == "s-pii"))
        doc = session_document(s, session)
    stored_result = doc.steps[1].observation.tool_results[0].content
    assert EMAIL not in stored_result and "The build log shows no failures" in stored_result
    assert doc.steps[1].observation.messages[1].content["content"] == stored_result


def test_forget_deletes_texts_nothing_else_refers_to(factory, tenant, redactor):
    unique = "Only the forgotten session ever said this, at some length. " * 6
    _write(factory, redactor, _turns(tenant, "s-keep", RESULT))
    _write(factory, redactor, _turns(tenant, "s-gone", RESULT + "# forgotten\n" * 30, task=unique))
    with db.transaction(factory) as s:
        forget_session(s, "s-gone", tenant=tenant, actor="test")
    with factory() as s:
        assert _rows_holding(s, tenant, unique[:60]) == 0  # only its (deleted) user message referred to it
        assert _rows_holding(s, tenant, "# forgotten") == 0
        # Its answer's envelope is gone, but s-keep's (another envelope) still refers to the same text.
        assert _rows_holding(s, tenant, ANSWER[:60]) == 1
        assert _rows_holding(s, tenant, THOUGHT[:80]) == 1
        session = s.scalar(select(t.Session).where(t.Session.tenant_id == tenant, t.Session.external_id == "s-keep"))
        doc = session_document(s, session)
    assert doc.steps[0].action.text == THOUGHT and doc.steps[1].action.text == ANSWER


def test_migration_escapes_old_rows_and_downgrade_writes_texts_back(new_database, redactor):
    url = new_database()
    db.upgrade(url, "0012")
    tenant = "t-mig"
    odd = {"role": "user", "content": [MARK + "@not-a-reference", MARK + "private use", "plain"]}
    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("INSERT INTO tenants (id) VALUES (:t)"), {"t": tenant})
        c.execute(text("INSERT INTO contents (tenant_id, hash, kind, body, size) VALUES (:t, 'old', 'message', "
                       "CAST(:b AS jsonb), 1)"), {"t": tenant, "b": json.dumps(odd)})
    db.upgrade(url)
    factory = db.session_factory(db.make_engine(url))
    with factory() as s:
        assert load_contents(s, tenant, {"old"}) == {"old": odd}
    steps = _turns(tenant, "s-mig", RESULT)
    _write(factory, redactor, steps)
    with factory() as s:
        session = s.scalar(select(t.Session).where(t.Session.tenant_id == tenant))
        hashes = {h for st in s.scalars(select(t.Step).where(t.Step.session_id == session.id))
                  for h in [*st.message_hashes, st.output_hash]}
        before = load_contents(s, tenant, hashes | {"old"})
    db.downgrade(url, "0012")
    with engine.connect() as c:
        rows = dict(c.execute(text("SELECT hash, body FROM contents WHERE tenant_id = :t AND hash = ANY(:h)"),
                              {"t": tenant, "h": sorted(hashes)}).all())
        texts = c.scalar(text("SELECT count(*) FROM contents WHERE kind = 'text'"))
    assert rows == {h: before[h] for h in hashes}  # whole bodies again, as 0012 readers expect
    assert texts == 0
    engine.dispose()
