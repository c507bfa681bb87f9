"""ATDP v1: the Agent Trajectory Data Protocol as pydantic models.

A *session* is one trajectory of an agent; each model call is a *step* of it. Feedback binds to a
session or a step; a *model version* records which steps trained it (lineage). Every step carries
its governance state. `atdp_schema/schema.json` is generated from these models
(`python -m atdp_schema.generate`) and `atdp_schema/README.md` describes every field.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ATDP_VERSION = "1.0"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=True)


class SessionStatus(StrEnum):
    open = "open"
    closed = "closed"
    deleted = "deleted"


class StepStatus(StrEnum):
    ok = "ok"
    error = "error"
    aborted = "aborted"


class Eligibility(StrEnum):
    eligible = "eligible"
    debug_only = "debug_only"
    audit_only = "audit_only"
    quarantined = "quarantined"
    deleted = "deleted"


class FeedbackSource(StrEnum):
    human = "human"
    user_correction = "user_correction"
    evaluator = "evaluator"
    environment = "environment"
    rule = "rule"


class VersionStatus(StrEnum):
    """A version's lifecycle: candidate -> evaluating -> (canary ->) serving -> retired.

    `rejected`: a gate failed; `rolled_back`: it served and an operator (or a trigger) restored the
    version before it; `failed`: its weights could not be loaded (swap error)."""

    candidate = "candidate"
    evaluating = "evaluating"
    canary = "canary"
    serving = "serving"
    retired = "retired"
    rejected = "rejected"
    rolled_back = "rolled_back"
    failed = "failed"


class GateState(StrEnum):
    """One gate of a version (replay evaluation, ...)."""

    pending = "pending"
    running = "running"
    passed = "passed"
    failed = "failed"
    skipped = "skipped"  # nothing to evaluate on (no held-out sessions, no operator suites)
    overridden = "overridden"  # the operator promoted the version without its gates
    error = "error"  # the gate could not run (engine or evaluator trouble)


class TokenSource(StrEnum):
    engine = "engine"  # ids exactly as the inference engine produced them
    rederived = "rederived"  # prompt ids re-tokenized from redacted text (no behaviour logprobs)
    dropped = "dropped"  # ids removed (redaction could not be made safe); step is audit_only
    none = "none"  # the call produced no token record (e.g. upstream error before any token)


Api = Literal["chat.completions", "responses", "messages"]


class ContentRef(_Model):
    """A pointer into the content-addressed store, with the content inlined when exported."""

    hash: str = Field(description="HMAC-SHA256 (hex) of the canonical raw content, per deployment secret.")
    content: Any | None = Field(default=None, description="The redacted content, when inlined.")


class Message(_Model):
    """One input message in the client's own API shape (OpenAI chat, Responses item, Anthropic)."""

    hash: str
    role: str | None = None
    content: Any = Field(description="The redacted message/item exactly as the client sent it.")


class ToolCall(_Model):
    id: str = Field(description="The tool call id the model emitted (call_..., toolu_..., fc_...).")
    name: str
    arguments: Any = Field(description="Arguments as emitted (a JSON string or object), redacted.")


class ToolResult(_Model):
    tool_call_id: str
    call_step_id: str | None = Field(
        default=None, description="The step whose action asked for this tool call, when known."
    )
    content: Any = None
    is_error: bool = False


class Observation(_Model):
    api: Api
    system: ContentRef | None = Field(default=None, description="The system prompt (instructions), by reference.")
    tools: ContentRef | None = Field(default=None, description="The tool schema list, by reference.")
    history_len: int = Field(
        description="How many input messages precede `messages` (inherited from the parent step)."
    )
    messages: list[Message] = Field(description="The input messages new since the parent step.")
    tool_results: list[ToolResult] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict, description="Sampling parameters (temperature, max_tokens ...).")


class Action(_Model):
    text: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    output: Any | None = Field(default=None, description="The assistant output in the client's API shape, redacted.")


class VersionRun(_Model):
    version: str = Field(description="Model version id that produced these tokens.")
    count: int = Field(ge=1)


class TokenRecord(_Model):
    source: TokenSource
    prompt_token_ids: list[int] = Field(default_factory=list, description="Full prompt ids as the engine rendered them.")
    output_token_ids: list[int] = Field(default_factory=list)
    output_logprobs: list[float] = Field(default_factory=list, description="Behaviour logprob of each output token.")
    output_versions: list[VersionRun] = Field(
        default_factory=list, description="Run-length encoded model version of each output token."
    )
    output_mask: list[int] | None = Field(
        default=None, description="1 = trainable output token, 0 = masked (e.g. its text was redacted). None = all 1."
    )
    finish_reason: str | None = None
    prompt_path: Literal["tito", "rendered"] | None = Field(
        default=None,
        description="How the prompt was built: 'tito' = the parent step's exact prompt+output ids followed by "
        "the new turn's rendering; 'rendered' = the engine rendered the client's messages. None = not an engine call.",
    )


class Timings(_Model):
    started_at: datetime
    ttft_ms: float | None = None
    total_ms: float | None = None


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = Field(default=None, description="Cost in the operator's unit, when priced.")


class StepError(_Model):
    type: str
    message: str
    status_code: int | None = None


class RedactionReport(_Model):
    counts: dict[str, int] = Field(default_factory=dict, description="Entity type -> number of values redacted.")


class Governance(_Model):
    redaction: RedactionReport = Field(default_factory=RedactionReport)
    eligibility: Eligibility
    eligibility_reason: str = ""
    visibility: Literal["tenant", "operator"] = "tenant"
    retention_until: datetime | None = None


class Layers(_Model):
    """The harness and memory versions a call was sent with (the proxy applied them before the call went
    out; the observation holds the request as the client sent it, the tokens what the model saw)."""

    harness_version: str | None = Field(default=None, description="Id of the harness version applied, if any.")
    memory_version: str | None = Field(default=None, description="Id of the memory version searched, if any.")
    memory_facts: list[str] = Field(default_factory=list, description="Ids of the facts put into the context.")


class Step(_Model):
    id: str
    session_id: str
    seq: int = Field(ge=1, description="Order of the step within its session, from 1.")
    parent_step_id: str | None = None
    status: StepStatus
    error: StepError | None = None
    upstream: str | None = None
    model: str | None = None
    model_version: str | None = Field(default=None, description="Version that served the first output token.")
    observation: Observation
    action: Action
    tokens: TokenRecord
    timings: Timings
    usage: Usage
    governance: Governance
    trained_in: list[str] = Field(default_factory=list, description="Model versions this step trained.")
    replay_of: str | None = Field(default=None, description="Original step id, when this step is a replay.")
    layers: Layers = Field(default_factory=Layers)


class Feedback(_Model):
    id: str
    session_id: str
    step_id: str | None = Field(default=None, description="None = the feedback is about the whole session.")
    scope: Literal["session", "step"]
    reward: float | None = None
    comment: str | None = None
    correction: str | None = None
    source: FeedbackSource
    posted_by: str | None = Field(default=None, description="Key id of the poster.")
    idempotency_key: str | None = None
    late: bool = Field(default=False, description="Arrived after the steps it scores were trained on.")
    created_at: datetime


class Session(_Model):
    atdp_version: str = ATDP_VERSION
    id: str
    tenant: str
    client: str | None = Field(default=None, description="Agent or harness (claude-code, codex, hermes, openai-python ...).")
    task_id: str | None = None
    status: SessionStatus
    started_at: datetime
    ended_at: datetime | None = None
    labels: dict[str, Any] = Field(default_factory=dict)
    reward: float | None = Field(default=None, description="Session reward after the tenant policy combined them.")
    replay_of: str | None = None
    steps: list[Step] = Field(default_factory=list)
    feedback: list[Feedback] = Field(default_factory=list)


class ModelVersion(_Model):
    id: str
    name: str
    parent: str | None = None
    checkpoint: str | None = Field(default=None, description="Weights directory (policy versions only).")
    status: VersionStatus
    layer: Literal["policy", "harness", "memory"] = "policy"
    scope: str | None = Field(default=None, description="The tenant a harness or memory version applies to; None: all.")
    spec: dict[str, Any] = Field(default_factory=dict, description="A harness overlay, or a memory version's facts.")
    training_run: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime
    served_at: datetime | None = None
    lineage: list[str] = Field(default_factory=list, description="Step ids whose tokens trained this version.")


class Document(_Model):
    """An ATDP export document: sessions and the model versions they reference."""

    atdp_version: str = ATDP_VERSION
    sessions: list[Session] = Field(default_factory=list)
    versions: list[ModelVersion] = Field(default_factory=list)
