"""Capture: what one model call did, assembled from vLLM's raw chat-completion output.

`ChatCapture` reads vLLM's chunks (or its one JSON answer; both through `proxy.translate.chunks`, the
reader the translated streams share) as they pass through the proxy and keeps
the prompt token ids, output token ids, their logprobs and token strings, the assistant text,
reasoning and tool calls, the finish reason and usage. Nothing is ever re-tokenized here.
`CapturedStep` is the raw record of the call; it lives only in memory until redaction. While the
writer has not made it durable the proxy holds it, so its per-token data is kept compact: token ids
as 32-bit machine ints, logprobs as 32-bit floats (what the store keeps, `real[]`), about 4 bytes a
token where python lists of ints and floats cost 30-40; `held_bytes` is what that hold costs.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from atdp_schema.record import StepFields
from proxy.translate.chunks import Chunk, read_chunk, read_completion


@dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ChatCapture:
    prompt_token_ids: Sequence[int] = field(default_factory=list)
    output_token_ids: array | list = field(default_factory=lambda: array("i"))
    output_logprobs: array = field(default_factory=lambda: array("f"))
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCallOut] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None
    response_id: str | None = None
    model: str | None = None
    weight_spans: list[dict[str, Any]] = field(default_factory=list)  # the engine's, when it reports them

    def feed(self, part: Chunk) -> None:
        """What one chunk (`read_chunk`) or a whole completion (`read_completion`) adds."""
        if self.response_id is None:
            self.response_id, self.model = part.id, part.model
        if part.prompt_token_ids:  # compact once: the token memory and the step copy it as bytes
            self.prompt_token_ids = compact_ids(part.prompt_token_ids)
        if part.usage:
            self.usage = part.usage
        if not part.has_choice:
            return
        if part.token_ids:
            self.output_token_ids = _extend_ids(self.output_token_ids, part.token_ids)
        if part.logprobs:  # the token strings beside each logprob are not kept: nothing reads them
            self.output_logprobs.extend([float(item.get("logprob", 0.0)) for item in part.logprobs])
        if part.content:
            self.text.append(part.content)
        if part.reasoning:
            self.reasoning.append(part.reasoning)
        for tc in part.tool_calls:
            idx = tc.get("index", 0)
            fn = tc.get("function") or {}
            cur = self.tool_calls.get(idx)
            if cur is None:
                cur = self.tool_calls[idx] = ToolCallOut(id=tc.get("id") or "", name=fn.get("name") or "")
            else:
                cur.id = cur.id or tc.get("id") or ""
                cur.name = cur.name or fn.get("name") or ""
            if fn.get("arguments"):
                cur.arguments += fn["arguments"]
        if part.finish_reason:
            self.finish_reason, self.stop_reason = part.finish_reason, part.stop_reason
        if part.weight_versions:
            self.weight_spans = list(part.weight_versions)

    def feed_chunk(self, chunk: dict[str, Any]) -> None:
        """One streamed `chat.completion.chunk` (only choice 0 is captured: n=1)."""
        self.feed(read_chunk(chunk))

    def feed_response(self, resp: dict[str, Any]) -> None:
        """A non-streamed `chat.completion`."""
        self.response_id = None
        self.feed(read_completion(resp))

    @property
    def has_output(self) -> bool:
        """Whether a first output arrived (token ids from vLLM; text or a tool call from a provider)."""
        return bool(self.output_token_ids or self.text or self.tool_calls or self.reasoning)

    @property
    def output_versions(self) -> list[str] | None:
        """Per output token, the weight version the engine reports sampling it with; None when the
        engine reported none (the chat route) or its spans do not cover the output exactly."""
        return spans_to_versions(self.weight_spans, len(self.output_token_ids))

    @property
    def output_text(self) -> str:
        return "".join(self.text)

    def assistant_message(self) -> dict[str, Any]:
        """The assistant turn as an OpenAI chat message (what a client echoes back next turn)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.output_text or None}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                for _, tc in sorted(self.tool_calls.items())
            ]
        return msg

    def action(self, native_output: Any, tool_names: dict[str, str] | None = None) -> dict[str, Any]:
        names = tool_names or {}
        return {
            "text": self.output_text or None,
            "reasoning": "".join(self.reasoning) or None,
            "tool_calls": [
                {"id": tc.id, "name": names.get(tc.name, tc.name), "arguments": tc.arguments}
                for _, tc in sorted(self.tool_calls.items())
            ],
            "output": native_output,
        }


@dataclass
class ToolResultIn:
    call_id: str
    content: Any
    is_error: bool = False


@dataclass
class SessionRef:
    tenant: str
    external_id: str
    source: str  # header | path | claude-code | codex | anthropic-metadata | continuation | new
    client: str | None = None
    task_id: str | None = None


@dataclass(kw_only=True)
class CapturedStep(StepFields):
    """The raw call: the fields every form of a step shares (atdp_schema.record.StepFields) and what
    redaction turns into contents, hashes and the token decision."""

    step_id: str
    session: SessionRef
    system: Any | None  # raw system prompt (content-addressed on write)
    tools: Any | None  # raw tool schema list
    new_messages: list[Any]  # raw, in the client's API shape
    tool_results: list[ToolResultIn]
    params: dict[str, Any]
    action: dict[str, Any]  # text / reasoning / tool_calls / output (client shape), raw
    # Held compact (`compact_ids`, `compact_logprobs`, in __post_init__): the writer reads them as sequences.
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    output_logprobs: Sequence[float]
    error: dict[str, Any] | None
    client_info: dict[str, Any] = field(default_factory=dict)
    # Fields of history messages that a chat template renders but the continuation key ignores
    # (`name`, `reasoning_content`): raw, scanned by the writer so token ids never carry them unseen.
    history_extras: list[dict[str, Any]] = field(default_factory=list)
    # A provider call (the routing table's LiteLLM model): no engine ids, supervised use only.
    provider: str | None = None
    # The weight version of each output token as the engine reported it (vLLM's WeightVersionSpan on
    # its token-in-token-out path); None when the engine did not say.
    output_versions: list[str] | None = None
    # (before, after): a keep-mode swap overlapped the call and the engine did not report versions,
    # so each token came from one of the two (proxy.upstream.Lease.window).
    version_window: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = compact_ids(self.prompt_token_ids)
        self.output_token_ids = compact_ids(self.output_token_ids)
        self.output_logprobs = compact_logprobs(self.output_logprobs)


def _packed(typecode: str, values: Sequence[float]) -> array:
    """`array(typecode, values)` ("i" or "f") at under half its cost: array converts item by item,
    parsing each as a call's arguments; struct converts them in one pass. Anything struct refuses
    goes through array, which raises what it always did (OverflowError beyond 32 bits, TypeError for
    a non-number). A few values (a streamed chunk's) are cheaper through array itself."""
    if len(values) < 32:
        return array(typecode, values)
    try:
        packed = struct.pack(f"{len(values)}{typecode}", *values)
    except (struct.error, OverflowError):
        return array(typecode, values)
    out = array(typecode)
    out.frombytes(packed)
    return out


def _extend_ids(ids: array | list, more: Sequence[int]) -> array | list:
    if isinstance(ids, array):
        n = len(ids)
        try:
            ids.extend(_packed("i", more) if ids.typecode == "i" and len(more) >= 32 else more)  # a chunk's few: as they are
            return ids
        except (OverflowError, TypeError):  # not 32-bit ints (no engine's are): kept as they came
            del ids[n:]  # what the failed extend appended before it stopped
            ids = ids.tolist()
    ids.extend(more)
    return ids


def compact_ids(ids: Sequence[int]) -> Sequence[int]:
    """Token ids as machine ints (4 bytes each; 8 for an id beyond 32 bits). Anything that is not
    all ints is left as it is: the writer decides what such ids are worth, as before."""
    if isinstance(ids, array):
        return ids
    try:
        return _packed("i", ids)
    except OverflowError:
        return array("q", ids)
    except TypeError:
        return ids


def compact_logprobs(values: Sequence[float]) -> Sequence[float]:
    """Logprobs as 32-bit floats. The engine computes them in float32 and the store keeps `real[]`,
    so the value written is the same bit for bit (a float32 read back as a double prints exactly)."""
    if isinstance(values, array):
        return values
    try:
        return _packed("f", values)
    except TypeError:
        return values


_LEAVES = (str, bytes, int, float, array, type(None))  # tuples, not `A | B`: built once, checked per object
_LEAF_TYPES = frozenset({str, bytes, int, float, bool, array, type(None)})  # exact types: one set lookup
_getsizeof = sys.getsizeof
_SEQS = (list, tuple)


def _deep_size(x: Any, depth: int = 0) -> int:
    """Bytes held by `x` and what it contains. JSON-shaped data (dicts, lists, strings, numbers) is
    walked with a leaf's size taken in place rather than through another call: a real agent's tool
    schemas (Claude Code's 63 KB) took 408 us a call the plain recursive way, 181 us so."""
    t = type(x)
    if t in _LEAF_TYPES or depth > 32:  # past 32 levels (pathological): the container only
        return _getsizeof(x)
    if t is dict:
        n = _getsizeof(x)
        for k, v in x.items():
            n += _getsizeof(k) if type(k) in _LEAF_TYPES else _deep_size(k, depth + 1)
            n += _getsizeof(v) if type(v) in _LEAF_TYPES else _deep_size(v, depth + 1)
        return n
    if t is list or t is tuple:
        n = _getsizeof(x)
        for v in x:
            n += _getsizeof(v) if type(v) in _LEAF_TYPES else _deep_size(v, depth + 1)
        return n
    # subclasses and other objects, the general way
    if isinstance(x, _LEAVES):
        return _getsizeof(x)
    if isinstance(x, dict):
        return _getsizeof(x) + sum(_deep_size(k, depth + 1) + _deep_size(v, depth + 1) for k, v in x.items())
    if isinstance(x, _SEQS):
        return _getsizeof(x) + sum(_deep_size(v, depth + 1) for v in x)
    if hasattr(x, "__dict__"):
        return _getsizeof(x) + _deep_size(vars(x), depth + 1)
    return _getsizeof(x)


# The dataclass, its session, ids, times and counts: bench/held_step.py traces about 950 bytes beyond
# what the walk below counts, at every step size; rounded up so the estimate errs on the high side.
_STEP_BASE = 1_200


def held_bytes(step: Any) -> int:
    """About what holding this step costs the proxy, in bytes (what ATDP_WRITER_HOLD_MB bounds).
    Shared objects (a version string repeated per token, interned keys) are counted each time, so it
    errs high (tests/unit/test_held_steps.py holds it to within 0.9-1.5x of tracemalloc's figure).
    Anything else held for the writer (a sealed stored response) is walked as it is."""
    if not isinstance(step, CapturedStep):
        return _deep_size(step)
    n = _STEP_BASE + sys.getsizeof(step.prompt_token_ids) + sys.getsizeof(step.output_token_ids)
    n += sys.getsizeof(step.output_logprobs)
    n += _repeated_size(step.system) + _repeated_size(step.tools)
    for part in (step.new_messages, step.tool_results, step.params, step.action, step.error, step.client_info,
                 step.history_extras, step.output_versions):
        if part:
            n += _deep_size(part)
    return n


# Parts an agent resends unchanged on every call (its system prompt, its tool schemas), by their JSON:
# hash -> (the JSON, the first object seen with it, its size), and id(object) -> size for those objects.
# Cleared when full. No lock: the event loop is the only caller; a race would cost one estimate.
_REPEATED: dict[int, tuple[bytes, Any, int]] = {}
_REPEATED_IDS: dict[int, int] = {}
_REPEATED_LIMIT = (256, 32 * 2**20)  # entries, bytes held
_repeated_held = [0]


def shared(part: Any) -> Any:
    """The object an earlier step holds for a part with the same JSON (else `part`, remembered). A
    step holding that object instead lets a batch to the writer pickle it once (pickle shares one
    object within a message) and the writer hash it once (`Preparer`): Hermes' 46 KB of system
    prompt and tools cost 25 us to pickle, 51 to unpickle and 42 to hash, per step. The JSON bytes
    are compared, not only hashed: a collision must not swap one agent's prompt for another's."""
    return _repeated(part)[0]


def _repeated(part: Any) -> tuple[Any, int]:
    """(`shared(part)`, `_deep_size(part)`), the size looked up rather than walked for a known part:
    serialising and hashing Hermes' 17 tool schemas takes 18 us, walking them 179."""
    if not part:
        return part, 0
    size = _REPEATED_IDS.get(id(part))
    if size is not None:  # the shared object itself (alive while remembered, so its id is its own)
        return part, size
    try:
        raw = orjson.dumps(part)
    except (TypeError, orjson.JSONEncodeError):  # not JSON-shaped: walk it
        return part, _deep_size(part)
    key = hash(raw)
    hit = _REPEATED.get(key)
    if hit is not None and hit[0] == raw:
        return hit[1], hit[2]
    size = _deep_size(part)
    if hit is not None:  # a 64-bit collision: the newer part takes the slot, the older is forgotten
        _REPEATED_IDS.pop(id(hit[1]), None)
        _repeated_held[0] -= hit[2] + len(hit[0])
    if len(_REPEATED) >= _REPEATED_LIMIT[0] or _repeated_held[0] + size + len(raw) > _REPEATED_LIMIT[1]:
        _REPEATED.clear()
        _REPEATED_IDS.clear()
        _repeated_held[0] = 0
    _REPEATED[key] = (raw, part, size)
    _REPEATED_IDS[id(part)] = size
    _repeated_held[0] += size + len(raw)
    return part, size


def shared_parts(step: CapturedStep) -> list[tuple[int, int]]:
    """(id, size) of the step's parts that are `shared` objects (alive while the step is): a holder
    of many steps counts each such object once (`WriterProcess`), as memory holds it once."""
    return [(id(p), size) for p in (step.system, step.tools) if p and (size := _REPEATED_IDS.get(id(p))) is not None]


def _repeated_size(part: Any) -> int:
    """`_deep_size` of a part an agent resends unchanged (see `_repeated`)."""
    return _repeated(part)[1]


def spans_to_versions(spans: list[dict[str, Any]], n_tokens: int) -> list[str] | None:
    """`WeightVersionSpan`s ({version, start, end}, contiguous) -> one version per output token."""
    if not spans:
        return None
    out: list[str] = []
    for s in spans:
        version, start, end = s.get("version"), s.get("start"), s.get("end")
        if not (isinstance(version, str) and isinstance(start, int) and isinstance(end, int)) or start != len(out):
            return None
        out.extend([version] * max(0, end - start))
    return out if len(out) == n_tokens else None


# Message fields a chat template may render that `proxy.sessions.match_key` does not compare.
UNKEYED_FIELDS = ("name", "reasoning_content", "reasoning")


def history_extras(history: list[Any]) -> list[dict[str, Any]]:
    """The unkeyed fields of a call's history messages, one dict per message that has any."""
    out = []
    for m in history:
        if isinstance(m, dict) and "role" in m:  # messages, not Responses items (their `name` is keyed)
            extra = {k: m[k] for k in UNKEYED_FIELDS if m.get(k) not in (None, "")}
            if extra:
                out.append(extra)
    return out


SAMPLING_PARAMS = (
    "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "max_output_tokens", "stop",
    "stop_sequences", "seed", "presence_penalty", "frequency_penalty", "tool_choice", "parallel_tool_calls",
    "n", "response_format", "reasoning", "reasoning_effort",
)


def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in SAMPLING_PARAMS if k in body}
