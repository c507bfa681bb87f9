"""What every route accepts, checked before anything reaches the upstream or the store.

Two kinds of checks live here, both pure (no I/O, no web library):
- identifiers (session ids, model names, tool call ids, `previous_response_id`, tenants, ...): a
  string of 1 to 256 characters with no control character. The store's columns hold 256 characters
  and PostgreSQL refuses NUL, so an id that breaks either is refused at the door instead of the
  client getting 200 and the step being set aside as a dead letter.
- request shapes: pydantic models of the three model doors' bodies and the feedback body. They type
  only what the proxy reads (everything else passes through to vLLM, `extra="allow"`), and they are
  the request-body schemas of the published OpenAPI document.

Error messages name the field, never its value: a value may hold PII.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

MAX_ID = 256  # the store's id columns (sessions.external_id, task_id, steps.model) are varchar(256)
MAX_TENANT = 128  # tenants.id is varchar(128)
MAX_DEPTH = 100  # JSON nesting; orjson cannot re-encode past 254 levels, agents send fewer than 20
ID_RULE = f"must be a string of 1 to {MAX_ID} characters without control characters"


def id_problem(value: object, max_len: int = MAX_ID) -> str | None:
    """Why `value` is not an acceptable identifier (None when it is)."""
    if not isinstance(value, str):
        return "must be a string"
    if not 0 < len(value) <= max_len:
        return f"must be 1 to {max_len} characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "must not contain control characters"
    return None


def session_id_problem(value: object) -> str | None:
    """A session id is also echoed in the `x-atdp-session-id` response header: printable ASCII only
    (a header cannot carry other characters; found by the fuzz test)."""
    if problem := id_problem(value):
        return problem
    if not str(value).isascii():
        return "must be printable ASCII (it is echoed in the x-atdp-session-id header)"
    return None


def text_problem(value: object, max_len: int) -> str | None:
    """Why `value` is not acceptable free text (a comment): a string, bounded, without NUL."""
    if not isinstance(value, str):
        return "must be a string"
    if len(value) > max_len:
        return f"must be at most {max_len} characters"
    if "\x00" in value:
        return "must not contain NUL characters"
    return None


def _identifier(value: str) -> str:
    if problem := id_problem(value):
        raise ValueError(problem)
    return value


def _session_id(value: str) -> str:
    if problem := session_id_problem(value):
        raise ValueError(problem)
    return value


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether parsed JSON (orjson's dicts and lists) nests deeper than `limit`. The walk recurses at
    most `limit` levels, so a deep body cannot crash it; it looks only into containers and leaves
    strings and numbers in place (Hermes' 46 KB of system prompt and tools: 190 -> 52 us)."""
    t = type(value)
    return (t is dict or t is list) and _deeper(value, limit)


def _deeper(node: dict[str, Any] | list[Any], budget: int) -> bool:
    if budget <= 0:
        return True
    for child in node.values() if type(node) is dict else node:
        t = type(child)
        if (t is dict or t is list) and _deeper(child, budget - 1):
            return True
    return False


# The pattern is published (OpenAPI), the check is `_identifier` (its message names the rule).
Identifier = Annotated[str, Field(min_length=1, max_length=MAX_ID, json_schema_extra={"pattern": "^[^\\x00-\\x1f\\x7f]*$"}),
                       AfterValidator(_identifier)]
SessionId = Annotated[str, Field(min_length=1, max_length=MAX_ID, json_schema_extra={"pattern": "^[\\x20-\\x7e]*$"}),
                      AfterValidator(_session_id)]


class _Open(BaseModel):
    # Strict: a number is not a string (a numeric tool_call_id is refused, not stringified).
    model_config = ConfigDict(extra="allow", strict=True)


# --- OpenAI chat completions ------------------------------------------------------------------------


class ChatFunctionCall(_Open):
    name: str | None = None
    arguments: str | None = None


class ChatToolCall(_Open):
    id: Identifier | None = None
    type: str | None = None
    function: ChatFunctionCall | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: Identifier | None = None


class StreamOptions(_Open):
    include_usage: bool | None = None


class ChatCompletionRequest(_Open):
    model: Identifier
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None  # the door allows only 1: a step is one sample
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    logprobs: bool | None = None


# --- Anthropic messages -------------------------------------------------------------------------------


class AnthropicBlock(_Open):
    type: str
    id: Identifier | None = None  # tool_use
    tool_use_id: Identifier | None = None  # tool_result


class AnthropicMessage(_Open):
    role: Literal["user", "assistant", "system"]  # Claude Code sends a `system` message in the list
    content: str | list[AnthropicBlock]


class AnthropicMetadata(_Open):
    user_id: str | None = None  # Claude Code: a JSON string holding session_id


class CountTokensRequest(_Open):
    model: Identifier
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool | None = None
    metadata: AnthropicMetadata | None = None


# --- OpenAI responses ----------------------------------------------------------------------------------


class ResponsesItem(_Open):
    type: str | None = None
    role: str | None = None
    call_id: Identifier | None = None  # function_call, function_call_output


class ClientMetadata(_Open):
    session_id: SessionId | None = None  # Codex


class ResponsesRequest(_Open):
    model: Identifier
    input: str | list[ResponsesItem] | None = None  # required: the translator says so in OpenAI's words
    instructions: str | None = None
    previous_response_id: Identifier | None = None
    stream: bool | None = None
    store: bool | None = None
    tools: list[dict[str, Any]] | None = None
    client_metadata: ClientMetadata | None = None


# --- ATDP control routes ---------------------------------------------------------------------------


class FeedbackRequest(BaseModel):
    """`POST /atdp/v1/sessions/{id}/feedback` (validated by `proxy.control.feedback.parse_feedback`;
    this model is its published schema)."""

    model_config = ConfigDict(extra="forbid")
    reward: float | None = None
    step_id: Identifier | None = None
    source: str | None = None
    comment: str | None = None
    correction: str | None = None
    idempotency_key: Identifier | None = None


class PolicyChange(BaseModel):
    """`PUT /atdp/v1/tenants/{tenant}/policy`: the policy keys to change (checked by `TenantPolicy`)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"minProperties": 1})


class VersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str = Field(min_length=1)
    name: str | None = Field(default=None, min_length=1, max_length=128)
    parent: str | None = Field(default=None, min_length=1, max_length=128)
    reason: str | None = Field(default=None, min_length=1, max_length=128)  # why (the override's audit row)
    promote: Literal["now"] | None = None  # the operator override: skip the gates (audited)
    wait: bool = False  # answer when the gates have decided, instead of 202 at once


class LayerVersionRequest(BaseModel):
    """POST /atdp/v1/versions for a harness or memory version (proxy.control.layers; docs/layers.md)."""

    model_config = ConfigDict(extra="forbid")
    layer: Literal["harness", "memory"]
    overlay: dict[str, Any] | None = None  # harness: system_append, tools, stop
    facts: list[str] | None = Field(default=None, min_length=1, max_length=200)  # memory: added to the serving facts
    tenant: str | None = Field(default=None, min_length=1, max_length=128)  # scope (memory: the caller's tenant)
    name: str | None = Field(default=None, min_length=1, max_length=128)
    reason: str | None = Field(default=None, min_length=1, max_length=128)
    wait: bool = False


class ProposalRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str | None = Field(default=None, min_length=1, max_length=128)  # none: every tenant
    wait: bool = False  # answer when every proposal's gates have decided


# --- checking a body ------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


class ShapeError(Exception):
    """A body that does not fit its model: `message` names the field (never its value), `param` its path."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check(model: type[M], body: Any, *, style: Literal["openai", "anthropic"] = "openai") -> M:
    """`body` as `model`, or a ShapeError worded as the called API words it."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise shape_error(e, style) from None


def shape_error(e: ValidationError, style: Literal["openai", "anthropic"]) -> ShapeError:
    # Union members add their type name to the location ("content.str"): keep the body's path only,
    # and name the deepest failure (a union's last member that got furthest says most).
    errors = [(err, [str(x) for x in err["loc"] if isinstance(x, int) or not _is_type_tag(str(x))])
              for err in e.errors(include_input=False, include_url=False)]
    first, loc = max(errors, key=lambda x: len(x[1]))
    where = ".".join(loc) or "body"
    if first["type"] == "missing":
        if style == "openai":
            return ShapeError(f"Missing required parameter: '{where}'.", where)
        return ShapeError(f"{where}: Field required", where)
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        msg = "must be an object"  # pydantic's words name our class
    return ShapeError(f"{where}: {msg}", where)


def _is_type_tag(part: str) -> bool:
    # Body keys are snake_case; pydantic's union tags are types: "str", "list[...]", "ChatMessage".
    return "[" in part or part in ("str", "int", "float", "bool", "none") or part[:1].isupper()
