"""Persistence off the request path: bounded queue -> redaction -> batching writer, spool fallback.

The request path only calls `Recorder.submit()`, which never blocks and never touches the database.
A writer thread takes batches from the queue, prepares them (`proxy.record.prepare`: each *distinct
new* content redacted once, records built) and writes them in one transaction. When
PostgreSQL is down or slow, records go to the fsync'd spool and are written back, in order, when it
returns (and at the next start). When the queue is full, the overflow is redacted and spooled by a
side thread: the client is never slowed down and nothing is lost, and nothing raw reaches disk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from atdp_schema.models import Eligibility, TokenSource
from proxy.governance.policy import TenantPolicy
from proxy.governance.redaction import TextRedactor
from proxy.governance.tokens import TokenGuard, load_codec
from proxy.record.capture import CapturedStep
from proxy.record.prepare import Preparer, TokenPolicy
from proxy.record.spool import Spool
from proxy.store.ids import new_id
from proxy.store.write import (
    SessionInfo,
    StepRecord,
    write_steps,
)

log = logging.getLogger("atdp.writer")


class Recorder:
    def __init__(self, *, secret: bytes, factory: sessionmaker[Session] | None, spool: Spool,
                 redactor: TextRedactor, policy_for: Callable[[Session | None, str], TenantPolicy],
                 queue_size: int = 10_000, batch_size: int = 256, flush_interval_s: float = 0.05,
                 retry_interval_s: float = 1.0, token_policy: TokenPolicy | None = None) -> None:
        self.factory = factory
        self.spool = spool
        self.redactor = redactor
        self.preparer = Preparer(secret=secret, redactor=redactor, policy_for=policy_for, token_policy=token_policy,
                                 database=lambda: self.factory if self.db_ok else None)
        self.queue: queue.Queue[CapturedStep | None] = queue.Queue(maxsize=queue_size)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self._overflow = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atdp-spill")
        self._thread = threading.Thread(target=self._run, name="atdp-writer", daemon=True)
        self._stop = threading.Event()
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

    def use_tokenizer(self, spec: str) -> None:
        """Keep (cleaned) token ids of redacted steps from here on, with the served model's tokenizer."""
        self.preparer.token_policy = TokenGuard(load_codec(spec))

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
            return self.preparer.prepare(steps)
        except Exception:
            log.exception("redaction failed on a batch; retrying step by step")
        out = []
        for st in steps:
            try:
                out.extend(self.preparer.prepare([st]))
            except Exception as e:
                self.stats["errors"] += 1
                out.append(StepRecord(
                    id=st.step_id, session=SessionInfo(tenant_id=st.session.tenant, external_id=st.session.external_id,
                                                       client=st.session.client, task_id=st.session.task_id),
                    api=st.api, status=st.status, started_at=st.started_at, parent_step_id=st.parent_step_id,
                    # Unredacted, so only the error's type and status, never its message.
                    error={k: st.error.get(k) for k in ("type", "status_code")} if st.error else None,
                    upstream=st.upstream, model=st.model, model_version=st.model_version,
                    history_len=st.history_len, token_source=TokenSource.dropped, ttft_ms=st.ttft_ms, total_ms=st.total_ms,
                    prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens,
                    eligibility=Eligibility.quarantined, eligibility_reason=f"redaction failed: {type(e).__name__}",
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

    def prepare(self, steps: list[CapturedStep]) -> list[StepRecord]:
        """Redact and shape captured steps into records (safe to persist anywhere)."""
        return self.preparer.prepare(steps)

    def forget(self, tenant: str, *, step_ids: list[str] = (), content_hashes: list[str] | None = None) -> None:
        """Drop what memory holds of forgotten steps and contents (see Preparer.forget)."""
        self.preparer.forget(tenant, step_ids=step_ids, content_hashes=content_hashes)
