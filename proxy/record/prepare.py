"""Captured steps -> step records, safe to persist anywhere: content addressing, redaction of each
distinct new content once, the token policy for ids that touched redacted text, eligibility.

`Preparer` holds what that needs to remember (which contents are stored, which steps' context was
redacted, recent token sequences for prefix storage, tenants' policies for a few seconds);
`step_record` is the pure last step, shared with replay.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from atdp_schema.models import TokenSource
from atdp_schema.record import step_fields
from proxy.governance.policy import TenantPolicy, decide_eligibility
from proxy.governance.redaction import TextRedactor, elide_echoes
from proxy.governance.tokens import TokenDecision, TokenGuard
from proxy.lru import LRU, content_key, id_key
from proxy.record.capture import CapturedStep, SessionRef
from proxy.store import tables as t
from proxy.store.content import content_hash, keyed
from proxy.store.records import ContentRow, SessionInfo, StepRecord, ToolCallRow, ToolResultRow
from proxy.store.texts import ENCODED_KINDS, encode
from proxy.store.tokens import TRAINABLE_SOURCES, common_prefix, rle, step_versions

TokenPolicy = Callable[..., TokenDecision]

# Content kinds scanned as operator content: secrets only, no PII recognizers. Tool schemas are
# written by the agent's vendor and are full of ids, versions, dates and examples; system prompts are
# not on this list because applications template user data into them (names, emails, account
# details). docs/governance.md, "What is scanned".
OPERATOR_KINDS = frozenset({"tools"})


@dataclass(frozen=True)
class CacheSizes:
    """The writer's memory bounds (settings `writer_cache_entries`, `token_cache_tokens`, `token_cache_s`)."""

    entries: int = 100_000  # each of: contents known stored, steps' redaction state
    tokens: int = 16_000_000  # recent token sequences, in tokens (4 bytes each)
    token_age_s: float = 600.0  # ... and in age: a child call comes seconds to minutes after its parent


class TokenCache:
    """Recent steps' full token sequences (prompt + output), bounded by total tokens and by age.

    Lets a step store only the suffix of its prompt after its parent's sequence; a miss only stores
    a longer suffix, so the age bound makes the cache plateau within minutes under any steady load.
    """

    def __init__(self, max_tokens: int = 16_000_000, max_age_s: float = 600.0) -> None:
        self._items: OrderedDict[bytes | str, tuple[float, array]] = OrderedDict()
        self._total = 0
        self.max_tokens = max_tokens
        self.max_age_s = max_age_s

    def __len__(self) -> int:
        return len(self._items)

    @property
    def tokens(self) -> int:
        return self._total

    def put(self, step_id: str, ids: list[int] | array) -> None:
        a = ids if isinstance(ids, array) else array("i", ids)
        key = id_key(step_id)
        self.drop(step_id)
        self._items[key] = (time.monotonic(), a)
        self._total += len(a)
        oldest = time.monotonic() - self.max_age_s
        while self._items and (self._total > self.max_tokens or next(iter(self._items.values()))[0] < oldest):
            _, (_, old) = self._items.popitem(last=False)
            self._total -= len(old)

    def get(self, step_id: str | None) -> array | None:
        hit = self._items.get(id_key(step_id)) if step_id else None
        return hit[1] if hit is not None and hit[0] >= time.monotonic() - self.max_age_s else None

    def drop(self, step_id: str) -> None:
        old = self._items.pop(id_key(step_id), None)
        if old is not None:
            self._total -= len(old[1])


def retention_until(started_at: datetime, policy: TenantPolicy) -> datetime | None:
    return started_at + timedelta(days=policy.retention_days) if policy.retention_days else None


def step_record(st: CapturedStep, *, session: SessionInfo, refs: dict[str, Any], contents: list[ContentRow],
                tool_calls: list[ToolCallRow], tokens: TokenDecision, prefix_len: int, redaction: dict[str, int],
                eligibility: str, reason: str, retention: datetime | None,
                message_hashes: list[str] | None = None, params: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None) -> StepRecord:
    """The record of one captured call, from what preparing it decided (pure). `params` and `error`:
    their redacted forms (the captured ones are raw)."""
    return StepRecord(
        **step_fields(st), id=st.step_id, session=session, error=error, system_hash=refs["system"],
        tools_hash=refs["tools"], message_hashes=refs["messages"] if message_hashes is None else message_hashes,
        params=params if params is not None else {}, output_hash=refs["output"], contents=contents,
        tool_calls=tool_calls,
        tool_results=[ToolResultRow(call_id=r.call_id, result_hash=h, is_error=r.is_error) for r, h in refs["results"]],
        token_source=tokens.source, prompt_prefix_len=prefix_len, prompt_token_ids=tokens.prompt_ids[prefix_len:],
        output_token_ids=tokens.output_ids, output_logprobs=tokens.logprobs, output_versions=rle(tokens.versions),
        output_mask=tokens.output_mask, redaction=redaction, eligibility=eligibility, eligibility_reason=reason,
        retention_until=retention,
    )


def versions_of(st: CapturedStep) -> list[str]:
    return step_versions(len(st.output_token_ids), engine=st.output_versions, window=st.version_window,
                         served=st.model_version)


def version_window(st: CapturedStep) -> tuple[str, str] | None:
    """The swap window that makes the step's versions unknown (None when the engine reported them)."""
    if st.output_versions is not None and len(st.output_versions) == len(st.output_token_ids):
        return None
    return st.version_window


def engine_tokens(st: CapturedStep) -> TokenDecision:
    """The ids exactly as the engine produced them (source `none` when the call produced none). The
    captured machine arrays are passed on as they are: a copy to a list and back for the prefix
    check cost more than the rest of preparing an agent-sized step."""
    has = bool(st.output_token_ids or st.prompt_token_ids)
    return TokenDecision(TokenSource.engine if has else TokenSource.none, st.prompt_token_ids,
                         st.output_token_ids, st.output_logprobs, versions_of(st), None)


def dropped_tokens() -> TokenDecision:
    return TokenDecision(TokenSource.dropped, [], [], [], [], None)


class Preparer:
    def __init__(self, *, secret: bytes, redactor: TextRedactor,
                 policy_for: Callable[[Session | None, str], TenantPolicy],
                 database: Callable[[], sessionmaker[Session] | None], token_policy: TokenPolicy | None = None,
                 caches: CacheSizes | None = None) -> None:
        self.secret = secret
        self.redactor = redactor
        self.policy_for = policy_for
        self.database = database  # the session factory while the database is reachable, else None
        self.token_policy = token_policy  # governance hook for steps whose tokens touch redacted text
        caches = caches or CacheSizes()
        # Compact keys (proxy.lru): these two hold an entry per new content and per step.
        self._known: LRU[bytes, tuple] = LRU(caches.entries)  # content_key -> redaction counts' items
        self._context_redacted: LRU[bytes | str, bool] = LRU(caches.entries)  # id_key(step) -> touched redacted text
        self._outputs: LRU = LRU(10_000)  # redacted assistant outputs, for tool-call rows
        # (tenant, hash) -> (redacted value, counts) of what a step carries besides its contents:
        # params, error, history fields the continuation key ignores. Scanned once, never stored as contents.
        self._side: LRU = LRU(50_000)
        self.tokens = TokenCache(caches.tokens, caches.token_age_s)
        self._policies: dict[str, tuple[float, TenantPolicy]] = {}
        # Per tenant, the forget count (proxy.store.forgets) up to which `_known` has let go of every
        # deleted content; None until `catch_up` (a write then checks every tenant's references).
        self._applied: dict[str, int] | None = None
        self._ahead: dict[str, set[int]] = {}  # counts applied out of order, waiting for the gap
        self._lock = threading.Lock()

    def _policy(self, tenant: str) -> TenantPolicy:
        hit = self._policies.get(tenant)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        policy = None
        factory = self.database()
        if factory is not None:
            try:
                with factory() as s:
                    policy = self.policy_for(s, tenant)
            except Exception:
                policy = None
        if policy is None:
            policy = hit[1] if hit else self.policy_for(None, tenant)
        self._policies[tenant] = (time.monotonic() + 10.0, policy)
        return policy

    def prepare(self, steps: list[CapturedStep]) -> list[StepRecord]:
        """Redact and shape captured steps into records (safe to persist anywhere)."""
        with self._lock:
            return self._prepare(steps)

    def _prepare(self, steps: list[CapturedStep]) -> list[StepRecord]:
        # 1. Content-address everything and collect the distinct contents not yet redacted.
        planned: list[tuple[CapturedStep, dict[str, Any]]] = []
        todo: dict[tuple[str, str], tuple[str, Any]] = {}
        side_todo: dict[tuple[str, str], Any] = {}
        # Each object is serialised and hashed once a batch: a system prompt or tool list the steps
        # share (capture.shared), and a string, such as a tool result that is also its tool message's
        # content (the long texts of step 3). A dict elsewhere is hashed as it comes. The memo holds
        # each object, so an id is not reused while its entry stands.
        memo: dict[int, tuple[Any, str, int]] = {}
        sizes: dict[str, int] = {}

        def key_of(value: Any, shared: bool = False) -> tuple[str, int]:
            hit = memo.get(id(value))
            if hit is not None and hit[0] is value:
                return hit[1], hit[2]
            h, n = keyed(self.secret, value)
            if shared or isinstance(value, str):
                memo[id(value)] = (value, h, n)
            return h, n

        for st in steps:
            tenant = st.session.tenant
            items: dict[str, Any] = {}

            def add(kind: str, value: Any, tenant: str = tenant, items: dict = items) -> str:
                h, size = key_of(value, kind == "system" or kind == "tools")
                sizes[h] = size
                items.setdefault(h, (kind, value))
                if content_key(tenant, h) not in self._known:
                    todo.setdefault((tenant, h), (kind, value))
                return h

            def side(value: Any, tenant: str = tenant) -> str | None:
                if not _has_text(value):
                    return None
                h = content_hash(self.secret, value)
                if (tenant, h) not in self._side:
                    side_todo.setdefault((tenant, h), value)
                return h

            refs = {
                "system": add("system", st.system) if st.system is not None else None,
                "tools": add("tools", st.tools) if st.tools else None,
                "messages": [add("message", m) for m in st.new_messages],
                "output": add("output", st.action),
                "results": [(r, add("tool_result", r.content)) for r in st.tool_results],
                "items": items,
                "params": side(st.params),
                "error": side(elide_echoes(st.error)),
                "extras": [h for h in (side(x) for x in st.history_extras) if h],
            }
            planned.append((st, refs))

        # 2. Redact each distinct new content once (in parallel when a pool is configured).
        # A token guard (proxy.governance.TokenGuard) also gets the raw values removed, kept in memory
        # only, so it can find them in token ids.
        remember = self.token_policy.remember if isinstance(self.token_policy, TokenGuard) else None
        keys = list(todo)
        side_keys = list(side_todo)
        redacted: dict[tuple[str, str], tuple] = {}
        if keys or side_keys:
            values = [(tenant, todo[(tenant, h)][1]) for tenant, h in keys]
            values += [(tenant, side_todo[(tenant, h)]) for tenant, h in side_keys]
            operator = [todo[k][0] in OPERATOR_KINDS for k in keys] + [False] * len(side_keys)
            results = self.redactor.redact_many(values, with_values=remember is not None, operator=operator)
            redacted = {k: r for k, r in zip(keys, results, strict=False)}
            for k, r in zip(side_keys, results[len(keys):], strict=True):
                self._side.put(k, (r[0], dict(r[1])))
                if remember is not None:
                    remember(k[0], k[1], r[2])
            if remember is not None:
                for (tenant, h), r in redacted.items():
                    remember(tenant, h, r[2])

        # 3. Records.
        out: list[StepRecord] = []
        for st, refs in planned:
            tenant = st.session.tenant
            contents: list[ContentRow] = []
            counts_of: dict[str, dict[str, int]] = {}
            texts: dict[str, tuple[str, Any, int]] = {}
            for h, (kind, _value) in refs["items"].items():
                if (tenant, h) in redacted:
                    body, counts = redacted[(tenant, h)][:2]
                    stored = body
                    if kind in ENCODED_KINDS:  # long strings by reference (proxy.store.texts)
                        # keyed on the redacted text: a clean one is the key of the tool result, system
                        # prompt or echoed message that is the same value, so those rows are shared
                        stored, found = encode(body, key_of, kind)
                        texts.update(found)
                    contents.append(ContentRow(hash=h, kind=kind, body=stored, size=sizes[h],
                                               redaction=dict(counts), encoded=kind in ENCODED_KINDS))
                    self._known.put(content_key(tenant, h), tuple(counts.items()))  # () when clean: shared
                    if kind == "output":
                        self._outputs.put((tenant, h), body)
                counts_of[h] = dict(self._known.get(content_key(tenant, h), ()))
            # The rows those bodies refer to, each once: one that is this step's own content (a tool
            # result, the system prompt) or was stored before is that row already.
            for h, (kind, value, size) in texts.items():
                if h not in refs["items"] and content_key(tenant, h) not in self._known:
                    contents.append(ContentRow(hash=h, kind=kind, body=value, size=size, encoded=kind in ENCODED_KINDS))
                    self._known.put(content_key(tenant, h), ())
            for h in refs["extras"]:
                counts_of[h] = self._side_value(tenant, h)[1]
            out.append(self._record(st, refs, contents, counts_of))
        return out

    def _record(self, st: CapturedStep, refs: dict, contents: list[ContentRow], counts_of: dict) -> StepRecord:
        tenant = st.session.tenant
        policy = self._policy(tenant)
        # History fields the continuation key ignores (`name`, `reasoning_content`) are rendered into
        # the prompt like new messages: what they held counts as the prompt's.
        new_hashes = [refs["messages"], [refs["system"], refs["tools"]], refs["extras"]]
        input_counts: dict[str, int] = {}
        # Each content once: a chat system message is both the system prompt and the first message.
        for h in dict.fromkeys(h for group in new_hashes for h in group if h):
            for k, v in counts_of.get(h, {}).items():
                input_counts[k] = input_counts.get(k, 0) + v
        output_counts = counts_of.get(refs["output"], {})
        report = dict(input_counts)
        params, params_counts = self._side_value(tenant, refs["params"], st.params)
        error, error_counts = self._side_value(tenant, refs["error"], elide_echoes(st.error))
        # Params (stop strings, response_format schemas) and the error message are stored, not
        # rendered into the prompt: they count in the step's report, not against its token ids.
        for counts in (output_counts, params_counts, error_counts):
            for k, v in counts.items():
                report[k] = report.get(k, 0) + v

        # Token ids carry the raw text: if the prompt or output touched redacted text, the
        # governance token policy decides (re-derive, mask, or drop); by default: drop.
        parent_dirty = self._parent_context_redacted(st.parent_step_id, st.session)
        prompt_dirty = parent_dirty or bool(input_counts)
        tokens = engine_tokens(st)
        if tokens.source == TokenSource.engine and (prompt_dirty or output_counts):
            if self.token_policy is not None:
                tokens = self.token_policy(st, prompt_dirty=prompt_dirty, output_counts=output_counts,
                                           parent_dirty=parent_dirty, refs=refs, counts_of=counts_of)
            else:
                tokens = dropped_tokens()
        self._context_redacted.put(id_key(st.step_id), prompt_dirty or bool(output_counts))

        # Store the prompt as the suffix after the parent's prompt+output (history stored once).
        prefix_len = 0
        parent_seq = self.tokens.get(st.parent_step_id)
        if tokens.source in TRAINABLE_SOURCES:
            prompt = array("i", tokens.prompt_ids)  # once: compared, then cached (C-speed slices)
            if parent_seq is not None:
                prefix_len = common_prefix(parent_seq, prompt)
            prompt.extend(tokens.output_ids)  # cached as stored, so prefixes rebuild exactly
            self.tokens.put(st.step_id, prompt)

        eligibility, reason = decide_eligibility(
            policy, status=st.status, redaction_counts=report, tokens_available=tokens.source in TRAINABLE_SOURCES,
            provider=st.provider, version_window=version_window(st),
        )
        return step_record(
            st, session=SessionInfo(tenant_id=tenant, external_id=st.session.external_id, client=st.session.client,
                                    client_info=st.client_info, task_id=st.session.task_id),
            refs=refs, contents=contents,
            tool_calls=[ToolCallRow(call_id=tc["id"], name=tc["name"], arguments=self._redacted_args(tc, refs, st))
                        for tc in st.action.get("tool_calls", []) if tc.get("id")],
            tokens=tokens, prefix_len=prefix_len, redaction=report, eligibility=eligibility, reason=reason,
            retention=retention_until(st.started_at, policy), params=params, error=error,
        )

    def cache_sizes(self) -> dict[str, int]:
        """Entries in each bounded cache (tokens for the token cache): what /healthz and a soak show."""
        return {"contents_known": len(self._known), "steps_redaction_state": len(self._context_redacted),
                "outputs": len(self._outputs), "side_values": len(self._side), "token_steps": len(self.tokens),
                "tokens": self.tokens.tokens}

    def seen(self, tenants: list[str]) -> dict[str, int | None]:
        """The forget counts the cache reflects now, for a batch about to be prepared (taken before it:
        a forget applied meanwhile only makes the write check what it need not)."""
        with self._lock:
            return {tn: None if self._applied is None else self._applied.get(tn, 0) for tn in tenants}

    def catch_up(self, counts: dict[str, int] | None) -> None:
        """Forgets may have been missed (a listener away, a new writer): nothing is believed stored, and
        the counts read now are what the empty cache reflects; None, when they cannot be read: unknown.
        Forgets applied meanwhile (`_ahead`) stay applied: one counted after the read moves a count on."""
        with self._lock:
            self._known.clear()
            self._applied = None if counts is None else dict(counts)
            for tenant in list(self._ahead):
                self._advance(tenant)

    def _count(self, tenant: str, n: int) -> None:
        """Forget number `n` of the tenant is applied: the count moves on over every contiguous one."""
        self._ahead.setdefault(tenant, set()).add(n)
        self._advance(tenant)

    def _advance(self, tenant: str) -> None:
        if self._applied is None:
            return  # kept in `_ahead` for the counts `catch_up` reads
        done, ahead = self._applied.get(tenant, 0), self._ahead.get(tenant, set())
        while done + 1 in ahead:
            done += 1
        self._applied[tenant] = done
        if rest := {n for n in ahead if n > done}:
            self._ahead[tenant] = rest
        else:
            self._ahead.pop(tenant, None)

    def forget(self, tenant: str, *, step_ids: list[str] = (), content_hashes: list[str] | None = None,
               forgets: Iterable[int] = ()) -> None:
        """Drop what memory holds of forgotten steps and contents (all of a tenant's when hashes is None),
        so a deleted content is written again, not assumed stored. Called by proxy.forget's callers;
        `forgets`: the forgets' counts (proxy.store.forgets), given once all they deleted is dropped."""
        with self._lock:
            if content_hashes is None:  # keys are digests: a whole tenant's cannot be told apart
                self._known.clear()  # (a miss only redacts that content again)
            else:
                for h in content_hashes:
                    self._known.pop(content_key(tenant, h), None)
            for sid in step_ids:
                self._context_redacted.pop(id_key(sid), None)
                self.tokens.drop(sid)
            self._policies.pop(tenant, None)
            if isinstance(self.token_policy, TokenGuard):
                self.token_policy.forget(tenant, content_hashes=content_hashes, step_ids=step_ids)
            for n in forgets:
                self._count(tenant, n)

    def _side_value(self, tenant: str, h: str | None, raw: Any = None) -> tuple[Any, dict[str, int]]:
        """The redacted form of a side value (params, error, history extras) and what was found.
        `h` None: the value holds no text, so it is stored as it came."""
        if h is None:
            return raw, {}
        hit = self._side.get((tenant, h))
        if hit is None:  # evicted between scan and record (a very large batch): store nothing raw
            return ({"type": raw.get("type"), "status_code": raw.get("status_code")} if isinstance(raw, dict)
                    and "message" in raw else {}), {}
        return hit

    def _redacted_args(self, tc: dict, refs: dict, st: CapturedStep) -> Any:
        """A tool call's arguments as stored: taken from the redacted output content."""
        body = self._outputs.get((st.session.tenant, refs["output"])) or {}
        for call in body.get("tool_calls", []):
            if call.get("id") == tc["id"]:
                return call.get("arguments")
        return None

    def _parent_context_redacted(self, parent_id: str | None, session: SessionRef) -> bool:
        if not parent_id:
            return False
        hit = self._context_redacted.get(id_key(parent_id))
        if hit is not None:
            return hit
        factory = self.database()
        if factory is None:
            return True  # unknown: assume the worst, never leak through tokens
        try:
            with factory() as s:
                row = t.get_session_step(s, parent_id, session.tenant, session.external_id)
        except Exception:
            return True
        if row is None:
            return True
        return row.token_source != TokenSource.engine or bool(row.redaction)


def _has_text(value: Any) -> bool:
    """Whether a value holds anything redaction could find: a string of 6+ characters, an object key,
    or a number of 7+ digits. Most params (`temperature`, `max_tokens`) hold none."""
    if isinstance(value, str):
        return len(value) >= 6
    if isinstance(value, dict):
        return any(len(k) >= 6 or _has_text(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_text(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return len(str(abs(value))) >= 7
    return False
