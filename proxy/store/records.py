"""The records a redacted step is written from: what leaves the redaction stage (`proxy.record.prepare`)
and goes to PostgreSQL (`proxy.store.write`) or, when the database is away, to the spool. Every text
in them is already redacted; they are plain JSON-able data."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from atdp_schema.models import Eligibility
from atdp_schema.record import StepFields


@dataclass
class ContentRow:
    hash: str
    kind: str  # message | system | tools | output | text
    body: Any  # redacted
    size: int
    redaction: dict[str, int] = field(default_factory=dict)
    # Body already in stored form (proxy.store.texts.encode); False (older spooled records, replay):
    # a body of an encoded kind is escaped on write.
    encoded: bool = False


@dataclass
class ToolCallRow:
    call_id: str
    name: str
    arguments: Any  # redacted


@dataclass
class ToolResultRow:
    call_id: str
    result_hash: str | None
    is_error: bool = False


@dataclass
class SessionInfo:
    tenant_id: str
    external_id: str
    client: str | None = None
    client_info: dict[str, Any] = field(default_factory=dict)
    task_id: str | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    replay_of: str | None = None  # internal id of the original session


@dataclass(kw_only=True)
class StepRecord(StepFields):
    """A redacted step: the fields every form of a step shares (atdp_schema.record.StepFields) and what
    preparing it decided. Its fields, but for the session and the rows of other tables, are the `steps`
    columns (proxy.store.write.STEP_COLUMNS)."""

    id: str
    session: SessionInfo
    error: dict[str, Any] | None = None
    system_hash: str | None = None
    tools_hash: str | None = None
    message_hashes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    output_hash: str | None = None
    contents: list[ContentRow] = field(default_factory=list)
    tool_calls: list[ToolCallRow] = field(default_factory=list)
    tool_results: list[ToolResultRow] = field(default_factory=list)
    token_source: str = "none"
    prompt_prefix_len: int = 0
    # Lists, or the capture's machine arrays (`array`) as the writer passes them on.
    prompt_token_ids: Sequence[int] = field(default_factory=list)  # suffix after prompt_prefix_len
    output_token_ids: Sequence[int] = field(default_factory=list)
    output_logprobs: Sequence[float] = field(default_factory=list)
    output_versions: list[list[Any]] = field(default_factory=list)  # [[version_id, count], ...]
    output_mask: list[int] | None = None
    redaction: dict[str, int] = field(default_factory=dict)
    eligibility: str = Eligibility.eligible
    eligibility_reason: str = ""
    visibility: str = "tenant"
    retention_until: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in _ARRAY_FIELDS:  # the writer's machine arrays as JSON lists (the spool)
            if isinstance(data[key], array):
                data[key] = data[key].tolist()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRecord:
        data = dict(data)
        data["session"] = SessionInfo(**data["session"])
        data["contents"] = [ContentRow(**c) for c in data.get("contents", [])]
        data["tool_calls"] = [ToolCallRow(**c) for c in data.get("tool_calls", [])]
        data["tool_results"] = [ToolResultRow(**c) for c in data.get("tool_results", [])]
        for key in ("started_at", "retention_until"):
            if isinstance(data.get(key), str):
                data[key] = datetime.fromisoformat(data[key])
        return cls(**data)


# StepRecord fields that are not `steps` columns: the session (its own row) and other tables' rows.
NOT_COLUMNS = frozenset({"session", "contents", "tool_calls", "tool_results"})
_ARRAY_FIELDS = ("prompt_token_ids", "output_token_ids", "output_logprobs", "output_mask")
