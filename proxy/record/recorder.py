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
from pathlib import Path
from typing import Literal

from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from atdp_schema.models import Eligibility, TokenSource
from atdp_schema.record import step_fields
from proxy.governance.policy import TenantPolicy
from proxy.governance.redaction import TextRedactor
from proxy.governance.tokens import TokenGuard, load_codec
from proxy.record.capture import CapturedStep
from proxy.record.durability import InFlight, Item, WriterHealth
from proxy.record.prepare import CacheSizes, Preparer, TokenPolicy
from proxy.record.spool import Spool, adopted
from proxy.store.db import db_error_reason
from proxy.store.forgets import StaleContents, counts
from proxy.store.ids import new_id
from proxy.store.records import SessionInfo, StepRecord
from proxy.store.write import SealedResponse, record_from_json, write_sealed_responses, write_steps

log = logging.getLogger("atdp.writer")


ADOPT_RECORDS = 4096  # records of other processes' spool folders written per look (Recorder.adopt)
Record = StepRecord | SealedResponse  # what it writes (or spools): every text in it already redacted (or sealed)


class Recorder:
    def __init__(self, *, secret: bytes, factory: sessionmaker[Session] | None, spool: Spool,
                 redactor: TextRedactor, policy_for: Callable[[Session | None, str], TenantPolicy],
                 queue_size: int = 10_000, batch_size: int = 256, flush_interval_s: float = 0.05,
                 retry_interval_s: float = 1.0, token_policy: TokenPolicy | None = None,
                 caches: CacheSizes | None = None, orphans: Callable[[], list[Path]] | None = None,
                 adopt_interval_s: float = 30.0) -> None:
        self.factory = factory
        self.spool = spool
        # Other processes' spool folders under the same home (proxy.config.spool_folders): the ones no
        # live process holds are drained here (adopt); None: this writer adopts none.
        self.orphans = orphans
        self.adopt_interval_s = adopt_interval_s
        self._next_adopt = 0.0
        self.redactor = redactor
        self.preparer = Preparer(secret=secret, redactor=redactor, policy_for=policy_for, token_policy=token_policy,
                                 database=lambda: self.factory if self.db_ok else None, caches=caches)
        self.queue: queue.Queue[Item | None] = queue.Queue(maxsize=queue_size)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self._overflow = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atdp-spill")
        self._thread = threading.Thread(target=self._run, name="atdp-writer", daemon=True)
        self._stop = threading.Event()
        self.db_ok = factory is not None
        self._next_retry = 0.0
        self.stats = {"submitted": 0, "processed": 0, "written": 0, "spooled": 0, "overflow": 0, "errors": 0,
                      "adopted": 0}
        self.inflight = InFlight()  # answered steps not yet durable (feedback waits for them)
        self.spool_error: str | None = None  # the last spool failure, until a write succeeds again
        # Items that could not be made durable yet (the spool failed): retried, never dropped.
        self._held: list[Item] = []
        self._progress_at = time.monotonic()  # the last time a batch was made durable (or the queue was empty)
        self._held_lock = threading.Lock()
        self._give_up_at = 0.0  # set by stop(): how long a failing spool is retried on the way out
        self._catch_up = True  # the tenants' forget counts are to be read before the next batch

    # --- the request path ---------------------------------------------------------------------

    def submit(self, item: Item) -> None:
        if isinstance(item, CapturedStep):
            self.stats["submitted"] += 1
            self.inflight.add(item)
        if self.pending == 0:
            self._progress_at = time.monotonic()  # the lag clock starts with the first waiting item
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.stats["overflow"] += 1
            self._overflow.submit(self._spill, [item])

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def pending(self) -> int:
        """Items submitted but not yet durable (written or spooled)."""
        return self.queue.unfinished_tasks + len(self._held)

    def connect(self, url: str, factory: sessionmaker[Session]) -> None:
        """The database is reachable (now, or again after start-up): write to it from here on."""
        self.factory = factory
        self.db_ok = True

    def use_tokenizer(self, spec: str) -> None:
        """Keep (cleaned) token ids of redacted steps from here on, with the served model's tokenizer."""
        self.preparer.token_policy = TokenGuard(load_codec(spec))

    def stop(self, timeout: float = 30.0) -> None:
        """Flush what is queued (to the database, or the spool) and stop."""
        self._give_up_at = time.monotonic() + max(0.0, timeout - 2 * self.retry_interval_s)
        self._stop.set()
        self.queue.put(None)
        self._thread.join(timeout)
        self._overflow.shutdown(wait=True)
        if self.pending:
            log.error("writer stopped with %d items not durable (the spool kept failing: %s)",
                      self.pending, self.spool_error)
        self.spool.close()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is written or spooled (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pending == 0:
                return True
            time.sleep(0.01)
        return False

    def refusing(self) -> str | None:
        """Why new calls must be refused (503) rather than answered and lost; None when they may go."""
        return f"the capture spool cannot be written ({self.spool_error})" if self.spool_error else None

    def health(self) -> WriterHealth:
        # Lag: how long items have waited without the writer making progress (a batch made durable).
        pending = self.pending
        return WriterHealth(mode="thread", alive=self._thread.is_alive() or not self._thread.ident, restarts=0,
                            held=pending, oldest_held_s=time.monotonic() - self._progress_at if pending else 0.0,
                            spool_error=self.spool_error, caches=self.preparer.cache_sizes())

    # --- durable writes (the writer thread here; the child's main loop in process mode) ---------

    def persist_now(self, items: list[Item]) -> None:
        """Make items durable now: prepared (redacted), then written, or spooled when the database is
        away. Raises (OSError from the spool) when neither took them; the caller keeps them."""
        self._catch_up_now()
        steps = [x for x in items if isinstance(x, CapturedStep)]
        sealed: list[Record] = [x for x in items if isinstance(x, SealedResponse)]
        seen = self.preparer.seen(sorted({st.session.tenant for st in steps}))  # before: see Preparer.seen
        records: list[Record] = [*self._prepare_safely(steps), *sealed] if steps else sealed
        captured = {st.step_id: st for st in steps}
        for i in range(0, len(records), self.batch_size):
            self._persist(records[i : i + self.batch_size], seen, captured)
        self.spool_error = None
        self._progress_at = time.monotonic()
        self.stats["processed"] += len(steps)
        self.inflight.done(steps)
        self._adopt_when_due()

    def _keep(self, items: list[Item], e: BaseException) -> None:
        self.stats["errors"] += 1
        self.spool_error = f"{type(e).__name__}: {e}"[:300]
        with self._held_lock:
            self._held[:0] = items
        log.error("could not make %d items durable (%s); holding them and refusing new calls until it works",
                  len(items), self.spool_error)

    # --- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        self._try_drain()
        stopping = False
        while True:
            with self._held_lock:
                held, self._held = self._held, []
            if stopping and not held:
                return
            got, batch = 0, []
            if not stopping:
                got, batch, stopping = self._take(wait=not held)
            items = held + batch
            try:
                if items:
                    self.persist_now(items)
                elif not stopping:
                    self._try_drain()
            except Exception as e:
                self._keep(items, e)
                if self._stop.is_set() and time.monotonic() > self._give_up_at:
                    return  # stop() reports what is still held
                time.sleep(self.retry_interval_s)
            finally:
                for _ in range(got):
                    self.queue.task_done()

    def _take(self, *, wait: bool) -> tuple[int, list[Item], bool]:
        """The next batch from the queue: (items taken incl. the stop marker, the batch, stopping)."""
        try:
            first = self.queue.get(timeout=self.retry_interval_s if wait else 0.0)
        except queue.Empty:
            return 0, [], False
        got, stopping = 1, first is None
        batch: list[Item] = [] if first is None else [first]
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
        return got, batch, stopping

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
                    **step_fields(st), id=st.step_id,
                    session=SessionInfo(tenant_id=st.session.tenant, external_id=st.session.external_id,
                                        client=st.session.client, task_id=st.session.task_id),
                    # Unredacted, so only the error's type and status, never its message.
                    error={k: st.error.get(k) for k in ("type", "status_code")} if st.error else None,
                    token_source=TokenSource.dropped, eligibility=Eligibility.quarantined,
                    eligibility_reason=f"redaction failed: {type(e).__name__}",
                ))
        return out

    def _spill(self, items: list[Item]) -> None:
        steps = [x for x in items if isinstance(x, CapturedStep)]
        try:
            records = [*self._prepare_safely(steps), *(x for x in items if isinstance(x, SealedResponse))]
            self.spool.append([r.to_json() for r in records])
            self.stats["spooled"] += len(steps)
            self.inflight.done(steps)
        except Exception as e:
            self._keep(items, e)  # the writer thread retries them

    def _write_json(self, records: list[dict]) -> None:
        self._write([record_from_json(r) for r in records])  # references checked; stale ones quarantined

    def _write_fresh(self, records: list[Record], seen: dict[str, int | None],
                     captured: dict[str, CapturedStep]) -> None:
        """Write records prepared from `captured` just now. A forget the cache had not heard of may have
        deleted contents they refer to (proxy.store.forgets): then the cache lets go of those and of
        the batch's own, and the batch is prepared again, so it carries every row it refers to."""
        for _ in range(3):
            try:
                self._write(records, seen=seen, on_stale="raise")
                return
            except StaleContents as e:
                steps = [r for r in records if isinstance(r, StepRecord)]
                drop = {tenant: set(hashes) for tenant, hashes in e.missing.items()}
                for r in steps:
                    drop.setdefault(r.session.tenant_id, set()).update(c.hash for c in r.contents)
                for tenant, hashes in drop.items():
                    self.preparer.forget(tenant, content_hashes=sorted(hashes))
                self.stats["reprepared"] = self.stats.get("reprepared", 0) + len(steps)
                log.info("%s; preparing %d step(s) again", e, len(steps))
                redo = [captured[r.id] for r in steps if r.id in captured]
                seen = self.preparer.seen(sorted({st.session.tenant for st in redo}))
                records = [*self._prepare_safely(redo), *(r for r in records if not isinstance(r, StepRecord)
                                                         or r.id not in captured)]
        self._write(records)  # forgets keep landing between tries: what still refers to one is quarantined

    def _write(self, records: list[Record], *, seen: dict[str, int | None] | None = None,
               on_stale: Literal["raise", "quarantine"] = "quarantine") -> None:
        """Write a batch; a batch the database refuses for its *content* is split, and a record that
        still fails alone is set aside in the spool's `rejected/` folder (redacted, like the spool),
        so one bad record can never block every later write. Connection failures raise."""
        steps = [r for r in records if isinstance(r, StepRecord)]
        sealed = [r for r in records if isinstance(r, SealedResponse)]
        try:
            with self.factory() as s, s.begin():
                self.stats["written"] += write_steps(s, steps, new_id, seen=seen, on_stale=on_stale)
                write_sealed_responses(s, sealed)
            return
        except (DataError, IntegrityError, ProgrammingError) as e:
            if len(records) == 1:
                self.stats["rejected"] = self.stats.get("rejected", 0) + 1
                # PostgreSQL's message may quote the row's values: the reason is the error's type
                # and SQLSTATE only (the record itself is the redacted one).
                self.spool.reject([records[0].to_json()], reason=db_error_reason(e))
                log.error("step %s refused by the database (%s); set aside in the spool's rejected/ folder",
                          records[0].id, type(e.orig).__name__)
                return
        for r in records:
            self._write([r], seen=seen, on_stale=on_stale)

    def _persist(self, records: list[Record], seen: dict[str, int | None] | None = None,
                 captured: dict[str, CapturedStep] | None = None) -> None:
        if self.db_ok and not self.spool.pending():
            try:
                self._write_fresh(records, seen or {}, captured or {})
                return
            except Exception as e:
                self.db_ok = False
                self._next_retry = time.monotonic() + self.retry_interval_s
                log.warning("database write failed (%s); spooling %d steps", type(e).__name__, len(records))
        self.spool.append([r.to_json() for r in records])
        self.stats["spooled"] += len(records)
        self._try_drain()

    def drain_spool(self) -> None:
        """Write spooled records back when the database is reachable (the child calls it when idle)."""
        self._try_drain()

    def _try_drain(self) -> None:
        if self.factory is None or time.monotonic() < self._next_retry:
            return
        if self.spool.pending():
            try:
                n = self.spool.drain(self._write_json)
                self.db_ok = True
                if n:
                    log.info("wrote %d spooled steps back to the database", n)
            except Exception as e:
                self.db_ok = False
                self._next_retry = time.monotonic() + self.retry_interval_s
                log.debug("spool drain deferred: %s", e)
                return
        self._adopt_when_due()

    def _adopt_when_due(self) -> None:
        if self.orphans is None or self.factory is None or not self.db_ok or time.monotonic() < self._next_adopt:
            return
        self._next_adopt = time.monotonic() + self.adopt_interval_s
        try:
            self.adopt()
        except Exception as e:  # the folder keeps its records; the next look tries again
            self.db_ok = False
            self._next_retry = time.monotonic() + self.retry_interval_s
            log.warning("draining another process's spool folder deferred: %s", db_error_reason(e))

    def adopt(self) -> int:
        """Drain every other spool folder no live process holds (a replica scaled away for good, or one
        that crashed and was not restarted, left it), each held while it is drained, so a replica
        starting meanwhile takes another. Their records were prepared by another writer: the write
        checks every content they refer to (a forget may have deleted it since). A look writes whole
        segments up to ADOPT_RECORDS and, if more is left, comes again after this writer's next batch:
        its own steps are not held behind a large folder. Returns records written."""
        done = 0
        for folder in self.orphans() if self.orphans is not None else []:
            if folder == self.spool.dir:
                continue
            with adopted(folder) as other:
                if other is None or not other.pending():
                    continue
                n = other.drain(self._write_json, limit=ADOPT_RECORDS - done)
                done += n
                self.stats["adopted"] += n
                log.info("wrote %d steps that a stopped process had spooled in %s", n, folder.name)
                if other.pending():
                    self._next_adopt = 0.0
                    break
        return done

    def prepare(self, steps: list[CapturedStep]) -> list[StepRecord]:
        """Redact and shape captured steps into records (safe to persist anywhere)."""
        return self.preparer.prepare(steps)

    def catch_up(self) -> None:
        """Forgets may have been missed (the notes listener reconnected): nothing is believed stored,
        and the forget counts are read again before the next batch (Preparer.catch_up)."""
        self.preparer.catch_up(None)
        self._catch_up = True

    def _catch_up_now(self) -> None:
        if not self._catch_up or self.factory is None or not self.db_ok:
            return
        try:
            with self.factory() as s:
                known = counts(s)
        except Exception as e:  # unknown counts: every write checks its references meanwhile
            log.debug("forget counts not read: %s", db_error_reason(e))
            return
        self.preparer.catch_up(known)
        self._catch_up = False

    def forget(self, tenant: str, *, step_ids: list[str] = (), content_hashes: list[str] | None = None,
               sessions: list[str] = (), whole_tenant: bool = False, forgets: list[int] = ()) -> None:
        """Drop what memory holds of forgotten steps and contents (see Preparer.forget), and the
        spool's pending records of the forgotten sessions (or of the whole tenant)."""
        self.preparer.forget(tenant, step_ids=step_ids, content_hashes=content_hashes, forgets=forgets)
        if sessions or whole_tenant:
            names, steps = set(sessions), set(step_ids)

            def forgotten(rec: dict) -> bool:
                if rec.get("kind") == SealedResponse.KIND:
                    return rec.get("tenant_id") == tenant and (whole_tenant or rec.get("step_id") in steps)
                ref = rec.get("session") or {}
                return ref.get("tenant_id") == tenant and (whole_tenant or ref.get("external_id") in names)

            if n := self.spool.purge(forgotten):
                log.info("forget: %d pending spool record(s) purged", n)
            # Folders no live process holds are purged here too (a live one's writer purges its own).
            for folder in self.orphans() if self.orphans is not None else []:
                if folder == self.spool.dir:
                    continue
                with adopted(folder) as other:
                    if other is not None and (n := other.purge(forgotten)):
                        log.info("forget: %d record(s) purged from the unheld spool folder %s", n, folder.name)
