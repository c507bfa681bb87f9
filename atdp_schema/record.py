"""The fields of a step that pass unchanged from the call's capture to its row in `steps`, defined once.

A step is held in three forms on its way to disk, each this class plus what its stage adds:
- `proxy.record.capture.CapturedStep`: the raw call (client-shaped messages, tools, action, per-token
  engine versions), in memory only until redaction;
- `proxy.store.records.StepRecord`: the redacted record (content hashes and rows, the token decision,
  eligibility), written to PostgreSQL or the spool; its fields are the `steps` columns
  (`proxy.store.write.STEP_COLUMNS` derives from them);
- `atdp_schema.models.Step`: the protocol's view of a stored row (nested: observation, action, tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(kw_only=True)
class StepFields:
    api: str  # chat.completions | messages | responses
    status: str  # ok | error | aborted (StepStatus)
    started_at: datetime
    parent_step_id: str | None = None
    upstream: str | None = None  # the replica's or provider's public label, never its credentials
    model: str | None = None
    model_version: str | None = None  # the weight version of the first output token
    history_len: int = 0  # messages of the request that an earlier step already recorded
    transcript_hash: str | None = None  # rolling hash of input + output: links the call that continues it
    prompt_path: str | None = None  # tito (the parent's exact ids + the new turn) | rendered | None (provider)
    finish_reason: str | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None  # a provider call's price from LiteLLM's cost map
    replay_of: str | None = None  # the original step, when this one is a replay
    # The layers the call was sent with (proxy.layers): harness and memory version ids, retrieved facts.
    harness_version: str | None = None
    memory_version: str | None = None
    memory_facts: list[str] | None = None  # ids of the facts memory put into the context (None: not searched)


STEP_FIELD_NAMES: tuple[str, ...] = tuple(StepFields.__dataclass_fields__)


def step_fields(step: StepFields) -> dict[str, object]:
    """The shared fields' values, to carry them into the next form of the step."""
    return {name: getattr(step, name) for name in STEP_FIELD_NAMES}
