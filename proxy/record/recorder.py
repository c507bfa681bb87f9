"""Persistence off the request path: bounded queue -> redaction -> batching writer, spool fallback.

The request path only calls `Recorder.submit()`, which never blocks and never touches the database.
A writer thread takes batches from the queue, redacts each *distinct new* content once (a hash
already seen is not rescanned), builds `StepRecord`s and writes them in one transaction. When
PostgreSQL is down or slow, records go to the fsync'd spool and are written back, in order, when it
returns (and at the next start). When the queue is full, the overflow is redacted and spooled by a
side thread: the client is never slowed down and nothing is lost, and nothing raw reaches disk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from proxy import tables as t
from proxy.capture import CapturedStep
from proxy.content import canonical, content_hash
from proxy.governance import decide_eligibility
from proxy.ids import new_id
from proxy.spool import Spool
from proxy.store import ContentRow, SessionInfo, StepRecord, ToolCallRow, ToolResultRow, rle, write_steps

log = logging.getLogger("atdp.writer")


class _LRU(OrderedDict):
    def __init__(self, max_items: int) -> None:
        super().__init__()
        self.max_items = max_items

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.max_items:
            self.popitem(last=False)


class TokenCache:
    """Recent steps' full token sequences (prompt + output), bounded by total tokens.

    Lets a step store only the suffix of its prompt after its parent's sequence.
    """

    def __init__(self, max_tokens: int = 16_000_000) -> None:
        self._items: OrderedDict[str, array] = OrderedDict()
        self._total = 0
        self.max_tokens = max_tokens

    def put(self, step_id: str, ids: list[int]) -> None:
        a = array("i", ids)
        self._items[step_id] = a
        self._total += len(a)
        while self._total > self.max_tokens and self._items:
            _, old = self._items.popitem(last=False)
            self._total -= len(old)

    def get(self, step_id: str | None) -> array | None:
        return self._items.get(step_id) if step_id else None

    def drop(self, step_id: str) -> None:
        old = self._items.pop(step_id, None)
        if old is not None:
            self._total -= len(old)


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: most of a long prompt is a shared prefix.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Recorder:
    def __init__(self, *, secret: bytes, factory: sessionmaker[Session] | None, spool: Spool, redactor,
                 policy_for: Callable[[Session | None, str], Any], queue_size: int = 10_000, batch_size: int = 256,
                 flush_interval_s: float = 0.05, retry_interval_s: float = 1.0, token_policy=None) -> None:
        self.secret = secret
        self.factory = factory
        self.spool = spool
        self.redactor = redactor
        self.policy_for = policy_for
        self.token_policy = token_policy  # governance hook for steps whose tokens touch redacted text
        self.queue: queue.Queue[CapturedStep | None] = queue.Queue(maxsize=queue_size)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self._known: _LRU = _LRU(500_000)  # (tenant, hash) -> redaction counts of stored content
        self._context_redacted: _LRU = _LRU(200_000)  # step id -> its prompt+output touched redacted text
        self._outputs: _LRU = _LRU(10_000)  # redacted assistant outputs, for tool-call rows
        self.tokens = TokenCache()
        self._policies: dict[str, tuple[float, Any]] = {}
        self._overflow = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atdp-spill")
        self._thread = threading.Thread(target=self._run, name="atdp-writer", daemon=True)
        self._stop = threading.Event()
        self._prepare_lock = threading.Lock()
        self.db_ok = factory is not None
        self._next_retry = 0.0
        self.stats = {"submitted": 0, "processed": 0, "written": 0, "spooled": 0, "overflow": 0, "errors": 0}

    # --- the request path ---------------------------------------------------------------------

    def submit(self, step: CapturedStep) -> None:
        self.stats["submitted"] += 1
        try:
            self.queue.put_nowait(step)
        except queue.Full:
            self.stats["overflow"] += 1
            self._overflow.submit(self._spill, [step])

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def pending(self) -> int:
        """Steps submitted but not yet written or spooled."""
        return self.queue.unfinished_tasks

    def connect(self, url: str, factory: sessionmaker[Session]) -> None:
        """The database is reachable (now, or again after start-up): write to it from here on."""
        self.factory = factory
        self.db_ok = True

    def stop(self, timeout: float = 30.0) -> None:
        """Flush what is queued (to the database, or the spool) and stop."""
        self._stop.set()
        self.queue.put(None)
        self._thread.join(timeout)
        self._overflow.shutdown(wait=True)
        self.spool.close()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is written or spooled (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    # --- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        self._try_drain()
        stopping = False
        while not stopping:
            try:
                first = self.queue.get(timeout=self.retry_interval_s)
            except queue.Empty:
                self._try_drain()
                continue
            got, stopping = 1, first is None
            batch = [] if first is None else [first]
            deadline = time.monotonic() + self.flush_interval_s
            while not stopping and len(batch) < self.batch_size:
                try:
                    nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                got += 1
                if nxt is None:
                    stopping = True
                else:
                    batch.append(nxt)
            while stopping:  # leaving: take everything still queued
                try:
                    x = self.queue.get_nowait()
                except queue.Empty:
                    break
                got += 1
                if x is not None:
                    batch.append(x)
            try:
                for i in range(0, len(batch), self.batch_size):
                    self._persist(self._prepare_safely(batch[i : i + self.batch_size]))
            except Exception:
                self.stats["errors"] += 1
                log.exception("writer failed on a batch of %d steps", len(batch))
            finally:
                self.stats["processed"] += len(batch)
                for _ in range(got):
                    self.queue.task_done()

    def _prepare_safely(self, steps: list[CapturedStep]) -> list[StepRecord]:
        """Prepare a batch; a step that cannot be redacted is kept as a content-free, quarantined record."""
        try:
            return self.prepare(steps)
        except Exception:
            log.exception("redaction failed on a batch; retrying step by step")
        out = []
        for st in steps:
            try:
                out.extend(self.prepare([st]))
            except Exception as e:
                self.stats["errors"] += 1
                out.append(StepRecord(
                    id=st.step_id, session=SessionInfo(tenant_id=st.session.tenant, external_id=st.session.external_id,
                                                       client=st.session.client, task_id=st.session.task_id),
                    api=st.api, status=st.status, started_at=st.started_at, parent_step_id=st.parent_step_id,
                    error=st.error, upstream=st.upstream, model=st.model, model_version=st.model_version,
                    history_len=st.history_len, token_source="dropped", ttft_ms=st.ttft_ms, total_ms=st.total_ms,
                    prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens,
                    eligibility="quarantined", eligibility_reason=f"redaction failed: {type(e).__name__}",
                ))
        return out

    def _spill(self, steps: list[CapturedStep]) -> None:
        try:
            self.spool.append([r.to_json() for r in self._prepare_safely(steps)])
            self.stats["spooled"] += len(steps)
        except Exception:
            log.exception("could not spool %d overflow steps", len(steps))

    def _write_json(self, records: list[dict]) -> None:
        self._write([StepRecord.from_json(r) for r in records])

    def _write(self, records: list[StepRecord]) -> None:
        """Write a batch; a batch the database refuses for its *content* is split, and a record that
        still fails alone is set aside in the spool's `rejected/` folder (redacted, like the spool),
        so one bad record can never block every later write. Connection failures raise."""
        try:
            with self.factory() as s, s.begin():
                self.stats["written"] += write_steps(s, records, new_id)
            return
        except (DataError, IntegrityError, ProgrammingError) as e:
            if len(records) == 1:
                self.stats["rejected"] = self.stats.get("rejected", 0) + 1
                self.spool.reject([records[0].to_json()], reason=f"{type(e).__name__}: {str(e.orig)[:300]}")
                log.error("step %s refused by the database (%s); set aside in the spool's rejected/ folder",
                          records[0].id, type(e.orig).__name__)
                return
        for r in records:
            self._write([r])

    def _persist(self, records: list[StepRecord]) -> None:
        if self.db_ok and not self.spool.pending():
            try:
                self._write(records)
                return
            except Exception as e:
                self.db_ok = False
                self._next_retry = time.monotonic() + self.retry_interval_s
                log.warning("database write failed (%s); spooling %d steps", type(e).__name__, len(records))
        self.spool.append([r.to_json() for r in records])
        self.stats["spooled"] += len(records)
        self._try_drain()

    def _try_drain(self) -> None:
        if self.factory is None or not self.spool.pending() or time.monotonic() < self._next_retry:
            return
        try:
            n = self.spool.drain(self._write_json)
            self.db_ok = True
            if n:
                log.info("wrote %d spooled steps back to the database", n)
        except Exception as e:
            self.db_ok = False
            self._next_retry = time.monotonic() + self.retry_interval_s
            log.debug("spool drain deferred: %s", e)

    # --- redaction and record building ----------------------------------------------------------

    def _policy(self, tenant: str):
        hit = self._policies.get(tenant)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        policy = None
        if self.factory is not None and self.db_ok:
            try:
                with self.factory() as s:
                    policy = self.policy_for(s, tenant)
            except Exception:
                policy = None
        if policy is None:
            policy = hit[1] if hit else self.policy_for(None, tenant)
        self._policies[tenant] = (time.monotonic() + 10.0, policy)
        return policy

    def prepare(self, steps: list[CapturedStep]) -> list[StepRecord]:
        """Redact and shape captured steps into records (safe to persist anywhere)."""
        with self._prepare_lock:
            return self._prepare(steps)

    def _prepare(self, steps: list[CapturedStep]) -> list[StepRecord]:
        # 1. Content-address everything and collect the distinct contents not yet redacted.
        planned: list[tuple[CapturedStep, dict[str, Any]]] = []
        todo: dict[tuple[str, str], tuple[str, Any]] = {}
        for st in steps:
            tenant = st.session.tenant
            items: dict[str, Any] = {}

            def add(kind: str, value: Any, tenant: str = tenant, items: dict = items) -> str:
                h = content_hash(self.secret, value)
                items.setdefault(h, (kind, value))
                if (tenant, h) not in self._known:
                    todo.setdefault((tenant, h), (kind, value))
                return h

            refs = {
                "system": add("system", st.system) if st.system is not None else None,
                "tools": add("tools", st.tools) if st.tools else None,
                "messages": [add("message", m) for m in st.new_messages],
                "output": add("output", st.action),
                "results": [(r, add("tool_result", r.content)) for r in st.tool_results],
                "items": items,
            }
            planned.append((st, refs))

        # 2. Redact each distinct new content once (in parallel when a pool is configured).
        # A token guard (proxy.governance.TokenGuard) also gets the raw values removed, kept in memory
        # only, so it can find them in token ids.
        remember = getattr(self.token_policy, "remember", None)
        keys = list(todo)
        if keys:
            values = [(tenant, todo[(tenant, h)][1]) for tenant, h in keys]
            if remember is None:
                if hasattr(self.redactor, "redact_many"):
                    results = self.redactor.redact_many(values)
                else:
                    results = [self.redactor.redact_value(v, tenant) for tenant, v in values]
            elif hasattr(self.redactor, "redact_many"):
                results = self.redactor.redact_many(values, with_values=True)
            else:
                results = []
                for tenant, v in values:
                    found: list[tuple[str, str]] = []
                    results.append((*self.redactor.redact_value(v, tenant, found=found), found))
            redacted = {k: r for k, r in zip(keys, results, strict=True)}
            if remember is not None:
                for (tenant, h), r in redacted.items():
                    remember(tenant, h, r[2])
        else:
            redacted = {}

        # 3. Records.
        out: list[StepRecord] = []
        for st, refs in planned:
            tenant = st.session.tenant
            contents: list[ContentRow] = []
            counts_of: dict[str, dict[str, int]] = {}
            for h, (kind, value) in refs["items"].items():
                if (tenant, h) in redacted:
                    body, counts = redacted[(tenant, h)][:2]
                    contents.append(ContentRow(hash=h, kind=kind, body=body, size=len(canonical(value)),
                                               redaction=dict(counts)))
                    self._known.put((tenant, h), dict(counts))
                    if kind == "output":
                        self._outputs.put((tenant, h), body)
                counts_of[h] = self._known.get((tenant, h), {})
            out.append(self._record(st, refs, contents, counts_of))
        return out

    def _record(self, st: CapturedStep, refs: dict, contents: list[ContentRow], counts_of: dict) -> StepRecord:
        tenant = st.session.tenant
        policy = self._policy(tenant)
        new_hashes = [refs["messages"], [refs["system"], refs["tools"]]]
        input_counts: dict[str, int] = {}
        for h in [h for group in new_hashes for h in group if h]:
            for k, v in counts_of.get(h, {}).items():
                input_counts[k] = input_counts.get(k, 0) + v
        output_counts = counts_of.get(refs["output"], {})
        report = dict(input_counts)
        for k, v in output_counts.items():
            report[k] = report.get(k, 0) + v

        # Token ids carry the raw text: if the prompt or output touched redacted text, the
        # governance token policy decides (re-derive, mask, or drop); by default: drop.
        parent_dirty = self._parent_context_redacted(st.parent_step_id)
        prompt_dirty = parent_dirty or bool(input_counts)
        has_tokens = bool(st.output_token_ids or st.prompt_token_ids)
        token_source = "engine" if has_tokens else "none"
        prompt_ids, output_ids = list(st.prompt_token_ids), list(st.output_token_ids)
        logprobs, versions = list(st.output_logprobs), [st.model_version or "unknown"] * len(st.output_token_ids)
        output_mask = None
        if has_tokens and (prompt_dirty or output_counts):
            if self.token_policy is not None:
                decision = self.token_policy(st, prompt_dirty=prompt_dirty, output_counts=output_counts,
                                             parent_dirty=parent_dirty, refs=refs, counts_of=counts_of)
                token_source = decision.source
                prompt_ids, output_ids, logprobs = decision.prompt_ids, decision.output_ids, decision.logprobs
                versions, output_mask = decision.versions, decision.output_mask
            else:
                token_source, prompt_ids, output_ids, logprobs, versions = "dropped", [], [], [], []
        self._context_redacted.put(st.step_id, prompt_dirty or bool(output_counts))

        # Store the prompt as the suffix after the parent's prompt+output (history stored once).
        prefix_len = 0
        parent_seq = self.tokens.get(st.parent_step_id)
        if token_source in ("engine", "rederived") and parent_seq is not None:
            prefix_len = common_prefix(parent_seq, prompt_ids)
        if token_source in ("engine", "rederived"):  # cached as stored, so prefixes rebuild exactly
            self.tokens.put(st.step_id, prompt_ids + output_ids)

        eligibility, reason = decide_eligibility(
            policy, status=st.status, redaction_counts=report, tokens_available=token_source in ("engine", "rederived")
        )
        retention = st.started_at + timedelta(days=policy.retention_days) if policy.retention_days else None
        return StepRecord(
            id=st.step_id,
            session=SessionInfo(tenant_id=tenant, external_id=st.session.external_id, client=st.session.client,
                                client_info=st.client_info, task_id=st.session.task_id),
            api=st.api, status=st.status, started_at=st.started_at, parent_step_id=st.parent_step_id,
            error=st.error, upstream=st.upstream, model=st.model, model_version=st.model_version,
            system_hash=refs["system"], tools_hash=refs["tools"], history_len=st.history_len,
            message_hashes=refs["messages"], params=st.params, transcript_hash=st.transcript_hash,
            output_hash=refs["output"], contents=contents,
            tool_calls=[ToolCallRow(call_id=tc["id"], name=tc["name"], arguments=self._redacted_args(tc, refs, st))
                        for tc in st.action.get("tool_calls", []) if tc.get("id")],
            tool_results=[ToolResultRow(call_id=r.call_id, result_hash=h, is_error=r.is_error) for r, h in refs["results"]],
            token_source=token_source, prompt_prefix_len=prefix_len, prompt_token_ids=prompt_ids[prefix_len:],
            output_token_ids=output_ids, output_logprobs=logprobs, output_versions=rle(versions),
            output_mask=output_mask, finish_reason=st.finish_reason, ttft_ms=st.ttft_ms, total_ms=st.total_ms,
            prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens, redaction=report,
            eligibility=eligibility, eligibility_reason=reason, retention_until=retention, replay_of=st.replay_of,
        )

    def forget(self, tenant: str, *, step_ids: list[str] = (), content_hashes: list[str] | None = None) -> None:
        """Drop what memory holds of forgotten steps and contents (all of a tenant's when hashes is None),
        so a deleted content is written again, not assumed stored. Called by proxy.forget's callers."""
        with self._prepare_lock:
            if content_hashes is None:
                for key in [k for k in self._known if k[0] == tenant]:
                    del self._known[key]
            else:
                for h in content_hashes:
                    self._known.pop((tenant, h), None)
            for sid in step_ids:
                self._context_redacted.pop(sid, None)
                self.tokens.drop(sid)
            self._policies.pop(tenant, None)
            if hasattr(self.token_policy, "forget"):
                self.token_policy.forget(tenant, content_hashes=content_hashes, step_ids=step_ids)

    def _redacted_args(self, tc: dict, refs: dict, st: CapturedStep) -> Any:
        """A tool call's arguments as stored: taken from the redacted output content."""
        body = self._outputs.get((st.session.tenant, refs["output"])) or {}
        for call in body.get("tool_calls", []):
            if call.get("id") == tc["id"]:
                return call.get("arguments")
        return None

    def _parent_context_redacted(self, parent_id: str | None) -> bool:
        if not parent_id:
            return False
        hit = self._context_redacted.get(parent_id)
        if hit is not None:
            return hit
        if self.factory is None or not self.db_ok:
            return True  # unknown: assume the worst, never leak through tokens
        try:
            with self.factory() as s:
                row = s.get(t.Step, parent_id)
        except Exception:
            return True
        if row is None:
            return True
        return row.token_source != "engine" or bool(row.redaction)

