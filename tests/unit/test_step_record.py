"""One definition of a step's fields: the capture and the record share atdp_schema.record.StepFields, the
COPY column list derives from StepRecord, the binary row follows it, and the ORM's `steps` table has
exactly those columns and the trainer's bookkeeping."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from atdp_schema.record import STEP_FIELD_NAMES, StepFields
from proxy.record.capture import CapturedStep
from proxy.store import tables as t
from proxy.store.copy import binary_float4s, binary_int4s, binary_texts
from proxy.store.records import NOT_COLUMNS, SessionInfo, StepRecord
from proxy.store.write import STEP_COLUMNS, _step_row

BOOKKEEPING = {"trained_version_id", "lease_owner", "lease_expires_at", "skipped_reason", "written_at"}


def test_capture_and_record_share_the_fields_and_define_none_of_them_again():
    assert issubclass(CapturedStep, StepFields) and issubclass(StepRecord, StepFields)
    for form in (CapturedStep, StepRecord):
        own = set(form.__dataclass_fields__) - set(STEP_FIELD_NAMES)
        assert [f.name for f in dataclasses.fields(form)][: len(STEP_FIELD_NAMES)] == list(STEP_FIELD_NAMES)
        assert not own & set(STEP_FIELD_NAMES)


def test_the_orm_table_has_the_records_columns_and_the_bookkeeping():
    record_columns = {f.name for f in dataclasses.fields(StepRecord)} - NOT_COLUMNS
    assert set(STEP_COLUMNS) == record_columns | {"session_id", "tenant_id", "seq"}
    assert len(STEP_COLUMNS) == len(set(STEP_COLUMNS))
    assert {c.name for c in t.Step.__table__.columns} == set(STEP_COLUMNS) | BOOKKEEPING


def test_the_binary_row_follows_the_column_list():
    """Every plain field gets a value of its own; the row must carry each one at its column's place."""
    values: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(StepRecord)):
        if f.name in NOT_COLUMNS:
            continue
        if f.name in ("started_at", "retention_until"):
            values[f.name] = datetime(2026, 1, 1 + i % 28, tzinfo=UTC)
        elif f.name in ("history_len", "prompt_tokens", "completion_tokens", "prompt_prefix_len"):
            values[f.name] = 1000 + i
        elif f.name in ("ttft_ms", "total_ms", "cost"):
            values[f.name] = 0.5 + i
        elif f.name in ("message_hashes", "memory_facts", "prompt_token_ids", "output_token_ids", "output_logprobs",
                        "output_mask", "output_versions", "error", "params", "redaction"):
            continue  # binary or JSON: checked below by their place
        else:
            values[f.name] = f"{f.name}-value"
    arrays = {"message_hashes": ["mh"], "memory_facts": ["mf1", "mf2"], "prompt_token_ids": [1],
              "output_token_ids": [2, 3], "output_logprobs": [0.5], "output_mask": [1, 0, 1]}
    documents = {"error": {"e": 1}, "params": {"p": 1}, "redaction": {"r": 1}, "output_versions": [["v", 1]]}
    r = StepRecord(**values, **arrays, **documents, session=SessionInfo(tenant_id="tenant-x", external_id="e"))
    row = _step_row(r, "sid-x", 7)
    assert len(row) == len(STEP_COLUMNS)
    by_column = dict(zip(STEP_COLUMNS, row, strict=True))
    assert by_column["id"] == "id-value" and by_column["session_id"] == "sid-x"
    assert by_column["tenant_id"] == "tenant-x" and by_column["seq"] == 7
    for name, value in values.items():
        assert by_column[name] == value, name
    binary = {"message_hashes": binary_texts, "memory_facts": binary_texts, "prompt_token_ids": binary_int4s,
              "output_token_ids": binary_int4s, "output_logprobs": binary_float4s, "output_mask": binary_int4s}
    for name, value in arrays.items():
        assert bytes(by_column[name]) == bytes(binary[name](value)), name
    for name, value in documents.items():
        assert by_column[name].obj == value, name
