"""What the writer redacts besides message contents: params, the error message, history fields the
continuation key ignores, and the operator scope of tool schemas. A real Redactor, no database."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from atdp_schema.models import TokenSource
from proxy.governance.policy import TenantPolicy
from proxy.governance.redaction import RedactionConfig, Redactor
from proxy.governance.tokens import ByteCodec, TokenGuard
from proxy.record.capture import CapturedStep, SessionRef, history_extras
from proxy.record.prepare import Preparer
from proxy.store.ids import new_id

EMAIL = "maria.gonzalez@fastmail.com"
PHONE = "+1 415-555-0132"


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(RedactionConfig(salt=b"test-salt"))


def preparer(redactor: Redactor, token_policy: Any = None) -> Preparer:
    return Preparer(secret=b"s", redactor=redactor, policy_for=lambda s, t: TenantPolicy(training_consent=True),
                    database=lambda: None, token_policy=token_policy)


def step(*, messages: list[dict], history: list[dict] = (), system: Any = None, tools: Any = None,
         params: dict | None = None, error: dict | None = None, prompt: str = "", parent: str | None = None
         ) -> CapturedStep:
    ids = list(prompt.encode())
    return CapturedStep(
        step_id=new_id(), session=SessionRef(tenant="acme", external_id="s1", source="header"), api="chat.completions",
        started_at=datetime.now(UTC), parent_step_id=parent, history_len=len(history), system=system, tools=tools,
        new_messages=messages, tool_results=[], params=params or {},
        action={"text": "ok", "reasoning": None, "tool_calls": [], "output": None},
        prompt_token_ids=ids if not error else [], output_token_ids=list(b"ok") if not error else [],
        output_logprobs=[0.0, 0.0] if not error else [], finish_reason="stop",
        status="error" if error else "ok", error=error, upstream=None, model="tiny", model_version="v1",
        ttft_ms=1.0, total_ms=2.0, prompt_tokens=len(ids), completion_tokens=2, transcript_hash=None,
        history_extras=history_extras(list(history)),
    )


def test_params_are_redacted(redactor: Redactor) -> None:
    params = {"temperature": 0.2, "stop": [f"mail {EMAIL}", "\n\n"],
              "response_format": {"type": "json_schema", "json_schema": {"name": "contact", "schema": {
                  "type": "object", "properties": {"email": {"const": EMAIL}, "phone": {"default": PHONE}}}}}}
    [rec] = preparer(redactor).prepare([step(messages=[{"role": "user", "content": "hi"}], params=params,
                                             prompt="hi")])
    dumped = json.dumps(rec.params)
    assert EMAIL not in dumped and "555-0132" not in dumped
    assert rec.params["temperature"] == 0.2 and rec.params["stop"][1] == "\n\n"
    assert rec.redaction == {"EMAIL_ADDRESS": 2, "PHONE_NUMBER": 1}
    # Stored, not rendered into the prompt: the token ids stay the engine's.
    assert rec.token_source == TokenSource.engine


def test_plain_params_are_kept_as_they_are(redactor: Redactor) -> None:
    params = {"temperature": 1, "max_tokens": 32000, "stop": ["</answer>"]}
    [rec] = preparer(redactor).prepare([step(messages=[{"role": "user", "content": "hi"}], params=params,
                                             prompt="hi")])
    assert rec.params == params and rec.redaction == {}


def test_the_error_message_is_stored_redacted(redactor: Redactor) -> None:
    error = {"type": "upstream_error", "status_code": 400,
             "message": f"1 validation error: input {{'role': 'user', 'content': 'call {PHONE} or {EMAIL}'}}"}
    [rec] = preparer(redactor).prepare([step(messages=[{"role": "user", "content": f"call {PHONE}"}], error=error)])
    assert rec.error is not None and rec.error["status_code"] == 400 and rec.error["type"] == "upstream_error"
    assert EMAIL not in rec.error["message"] and "555-0132" not in rec.error["message"]
    assert "<EMAIL_ADDRESS>" in rec.error["message"]


def test_history_fields_the_continuation_key_ignores_are_scanned(redactor: Redactor) -> None:
    # A history message whose `name` / `reasoning_content` changed is still "history" to the session
    # key, so it is not a new message; the template renders those fields into the prompt all the same.
    history = [{"role": "user", "content": "hello", "name": "maria_gonzalez"},
               {"role": "assistant", "content": "hi", "reasoning_content": f"user mail is {EMAIL}"}]
    prompt = f"hello hi user mail is {EMAIL} next"
    guard = TokenGuard(ByteCodec())
    [rec] = preparer(redactor, guard).prepare([step(messages=[{"role": "user", "content": "next"}],
                                                    history=history, prompt=prompt)])
    assert rec.redaction == {"EMAIL_ADDRESS": 1}
    # The token guard cleaned the ids: the value is not in them, the placeholder is.
    text = bytes(rec.prompt_token_ids).decode()
    assert EMAIL not in text and "<EMAIL_ADDRESS>" in text
    assert rec.token_source == TokenSource.rederived
    # Without a tokenizer such ids cannot be cleaned: dropped, never kept raw.
    [rec2] = preparer(redactor).prepare([step(messages=[{"role": "user", "content": "next"}], history=history,
                                              prompt=prompt)])
    assert rec2.token_source == TokenSource.dropped


def test_tool_schemas_are_operator_content_system_prompts_are_not(redactor: Redactor) -> None:
    tools = [{"type": "function", "function": {"name": "notify", "description": (
        f"Pages the on-call (owner ops@acme-corp.io, {PHONE}). Uses model claude-haiku-4-5-20251001."),
        "parameters": {"type": "object", "properties": {"channel": {"type": "string"}}}}}]
    system = {"role": "system", "content": f"You help {EMAIL}."}
    [rec] = preparer(redactor).prepare([step(messages=[system, {"role": "user", "content": "hi"}], system=system,
                                             tools=tools, prompt="hi")])
    stored = {c.kind: c.body for c in rec.contents}
    assert stored["tools"] == tools  # secrets only: nothing found, stored as sent
    assert EMAIL not in json.dumps(stored["system"])  # system prompts get the full scan
    assert rec.redaction == {"EMAIL_ADDRESS": 1}


def test_pydantic_echoes_are_elided_before_redaction(redactor: Redactor) -> None:
    # vLLM 0.32's 400 for a bad content part (as the real engine answers): the quoted input is cut in
    # the middle, leaving fragments (`maria.gonzalez@...-555-0132`) no recognizer can place.
    message = ("1 validation error for ValidatorIterator\n0.ChatCompletionContentPartTextParam.type\n"
               "  Input should be 'text' [type=literal_error, input_value='maria.gonzalez@...-555-0132', "
               "input_type=str]\n0.File.file\n  Field required [type=missing, input_value={'type': "
               "'maria.gonzalez@...-555-0132', 'text': 'x'}, input_type=dict]")
    error = {"type": "upstream_error", "status_code": 400, "message": message}
    [rec] = preparer(redactor).prepare([step(messages=[{"role": "user", "content": "x"}], error=error)])
    assert "maria" not in rec.error["message"] and "555-0132" not in rec.error["message"]
    assert "Input should be 'text'" in rec.error["message"] and "input_value=<elided>" in rec.error["message"]


def test_a_card_sent_as_a_bare_json_number_makes_the_step_dirty(redactor: Redactor) -> None:
    # Before: numbers were not scanned, so such a step counted as clean and kept raw token ids.
    result = {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"card": 4111111111111111, "n": 2})}
    prompt = '{"card": 4111111111111111, "n": 2}'
    [rec] = preparer(redactor).prepare([step(messages=[result], prompt=prompt)])
    assert rec.redaction == {"CREDIT_CARD": 1}
    assert rec.token_source == TokenSource.dropped  # no tokenizer: ids that held it cannot be kept
    stored = {c.kind: c.body for c in rec.contents}["message"]
    assert "4111111111111111" not in json.dumps(stored)


def test_the_record_keeps_the_captured_arrays_and_spools_as_lists(redactor: Redactor) -> None:
    """The writer passes the capture's machine arrays through to its record (no copy to a list and
    back per step); the spool's JSON still holds plain lists, and reads back to the same record."""
    import orjson

    from proxy.store.records import StepRecord

    parent = step(messages=[{"role": "user", "content": "hi"}], prompt="hi there")
    child = step(messages=[{"role": "user", "content": "more"}], prompt="hi thereok and more", parent=parent.step_id)
    prep = preparer(redactor)
    _, rec = prep.prepare([parent, child])
    assert type(child.prompt_token_ids).__name__ == "array"  # what the capture holds
    assert list(rec.prompt_token_ids) == list(b" and more") and rec.prompt_prefix_len == len(b"hi thereok")
    assert list(rec.output_token_ids) == list(b"ok") and list(rec.output_logprobs) == [0.0, 0.0]
    data = orjson.loads(orjson.dumps(rec.to_json(), option=orjson.OPT_NAIVE_UTC))
    assert data["prompt_token_ids"] == list(b" and more") and data["output_logprobs"] == [0.0, 0.0]
    back = StepRecord.from_json(data)
    assert back.prompt_token_ids == list(b" and more") and back.prompt_prefix_len == rec.prompt_prefix_len


def test_a_step_that_cannot_be_redacted_is_quarantined_with_its_shared_fields(redactor: Redactor, tmp_path,
                                                                              monkeypatch) -> None:
    """Nothing of its content is kept, but what every form of a step shares (atdp_schema.record) is: the
    layers it was sent with, its cost, its timings, how its prompt was built."""
    from atdp_schema.models import Eligibility
    from proxy.record.recorder import Recorder
    from proxy.record.spool import Spool

    recorder = Recorder(secret=b"s", factory=None, spool=Spool(tmp_path), redactor=redactor,
                        policy_for=lambda s, t: TenantPolicy(training_consent=True))
    st = step(messages=[{"role": "user", "content": f"mail {EMAIL}"}], prompt="hi",
              error={"type": "server_error", "status_code": 500, "message": f"echo {EMAIL}"})
    st.harness_version, st.memory_version, st.memory_facts = "h-id", "m-id", ["f1"]
    st.cost, st.prompt_path, st.replay_of = 0.25, "tito", "s-0"

    def refuse(steps: list) -> list:
        raise RuntimeError("the redactor is down")

    monkeypatch.setattr(recorder.preparer, "prepare", refuse)
    [rec] = recorder._prepare_safely([st])
    assert rec.eligibility == Eligibility.quarantined and rec.token_source == TokenSource.dropped
    assert rec.eligibility_reason == "redaction failed: RuntimeError"
    assert (rec.harness_version, rec.memory_version, rec.memory_facts) == ("h-id", "m-id", ["f1"])
    assert (rec.cost, rec.prompt_path, rec.replay_of, rec.finish_reason, rec.model) == (0.25, "tito", "s-0", "stop", "tiny")
    assert rec.error == {"type": "server_error", "status_code": 500} and rec.contents == [] and rec.params == {}
    assert EMAIL not in json.dumps(rec.to_json(), default=str)
