"""The writer in its own process, so redaction and database writes never hold the event loop's GIL.

The request path calls `WriterProcess.submit(step)`, which only appends to an in-memory list. A
sender thread ships batches to the child over a pipe, each with an id; the child runs the same
`Recorder` as the in-process mode (redaction of distinct new content, database write, spool when
the database is away) and acknowledges a batch only once it is durable (committed or fsync'd to
the spool). Until then the parent holds it:

- the child dies (OOM, kill -9): a supervisor thread restarts it with backoff and re-sends every
  unacknowledged batch. Writes are idempotent by step id (and stored-response id), so a batch the
  dead child had committed but not acknowledged is not duplicated.
- the child cannot make a batch durable (disk full on the spool): it answers `Nack`; the parent
  keeps the batch, retries it, and `refusing()` tells the doors to answer 503 until a write works.
- SIGTERM to the process group (systemd's default): the child ignores it; the parent's shutdown
  waits for every batch to be acknowledged, then stops the child; what is still held then is
  redacted and spooled here.
- the child is behind or gone and the proxy holds `writer_hold_mb` of answered steps (their
  `capture.held_bytes`) or `queue_size` of them: `refusing()` has the doors answer new calls 503
  with retry-after (backpressure), until acknowledgements bring it under. Why not spool the excess
  here: nothing raw may reach disk, so spooling means redacting in this process, which loads a
  second Presidio (part of the soak's +252% RSS, docs/benchmarks.md "Soak") and takes the event loop's CPU
  exactly when the machine is short of it; a client told to retry keeps its request, nothing is lost.
- calls admitted before the refusal began still finish and are held; only past twice either bound
  (a burst of long streams) is the overflow redacted here, on a side thread, and spooled as a
  closed segment the child writes back later.

Nothing raw reaches disk on any of these paths.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from sqlalchemy.orm import Session, sessionmaker

from proxy.config import Settings
from proxy.governance.policies import Policies
from proxy.record.capture import CapturedStep, held_bytes, shared_parts
from proxy.record.durability import InFlight, Item, WriterHealth
from proxy.record.recorder import Recorder
from proxy.record.spool import Spool
from proxy.record.writer_child import build_recorder, child_main
from proxy.record.writer_messages import (
    Ack,
    Batch,
    CatchUp,
    Connect,
    Control,
    Forget,
    FromChild,
    Nack,
    Ready,
    Stop,
    ToChild,
    UseTokenizer,
    WriterStats,
)

__all__ = ["WriterProcess", "build_recorder"]  # build_recorder: the in-process mode builds the same one

log = logging.getLogger("atdp.writer")

RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # a child that keeps dying is retried ever slower


@dataclass
class _Held:
    """An item the parent holds until the child acknowledges it durable."""

    seq: int  # submission order: re-sent batches keep it (a session's steps are numbered in this order)
    since: float  # monotonic time it was submitted
    item: Item
    size: int  # capture.held_bytes: what holding it costs, less its shared parts
    parts: list[tuple[int, int]] = field(default_factory=list)  # capture.shared_parts: counted once for all


class WriterProcess:
    """The Recorder's interface, backed by a supervised child process."""

    def __init__(self, settings: Settings, policies: Policies) -> None:
        self._ctx = mp.get_context("spawn")
        self.settings = settings
        self.policies = policies
        self.spool = Spool(settings.spool_dir)
        self.factory: sessionmaker[Session] | None = None
        self.inflight = InFlight()
        self.submitted = 0
        self.restarts = 0
        self.spool_error: str | None = None
        self._remote = WriterStats()  # the child's counters and caches, as its last message said
        self._db_url: str | None = None
        self._spilled = 0
        self._spilling = 0
        self._overflow = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atdp-spill")
        self._local: Recorder | None = None
        # Everything below is guarded by _cond.
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._bids = itertools.count(1)
        self._pending: deque[_Held] = deque()  # not yet sent
        self._unacked: dict[int, list[_Held]] = {}  # sent, not yet acknowledged
        self._held = 0
        self._held_bytes = 0
        self._parts: dict[int, list[int]] = {}  # a shared part's id -> [steps holding it, its size]
        self._hold_limit = int(settings.writer_hold_mb * 2**20)
        self._retry_at = 0.0  # after a nack: when to send again
        self._nacks = 0
        self._ready = False  # a child is running and connected
        self._gen = 0  # which child `_to_child` leads to (a send to an older one must not unready a newer)
        self._child_up = False  # the running child reported ready
        self._proc: mp.process.BaseProcess | None = None
        self._to_child: Connection | None = None
        self._receiver: threading.Thread | None = None
        self._send_lock = threading.Lock()  # one writer on the pipe at a time (the sender, _spawn)
        self._controls: deque[Control] = deque()  # control messages waiting for the sender thread
        self._closing = False  # stop() began: no more restarts
        self._closed = False

    # --- the request path ---------------------------------------------------------------------

    def submit(self, item: Item) -> None:
        """Hold an item until the child has made it durable (never blocks, never touches disk)."""
        if isinstance(item, CapturedStep):
            self.submitted += 1
            self.inflight.add(item)
        parts = shared_parts(item) if isinstance(item, CapturedStep) else []
        held = _Held(next(self._seq), time.monotonic(), item, held_bytes(item) - sum(n for _, n in parts), parts)
        with self._cond:
            # `refusing()` stops new calls at the bounds; these are calls admitted before it did.
            if self._held < 2 * self.settings.queue_size and self._held_bytes < 2 * self._hold_limit:
                self._pending.append(held)
                self._held += 1
                self._held_bytes += held.size + self._take_parts(held.parts)
                # Wake the sender only when it has something new to do: a first item (it sleeps until
                # one comes) or a full batch (send now, not at the deadline). In between it is waiting
                # for the batch's deadline anyway; a wake per call cost a thread switch per call.
                if len(self._pending) == 1 or len(self._pending) >= self.settings.batch_size:
                    self._cond.notify_all()
                return
            self._spilling += 1
        self._overflow.submit(self._spill, [held])

    def _spill(self, items: list[_Held]) -> None:
        """Redact and spool held items here (overflow, or what is left at shutdown)."""
        steps = [h.item for h in items if isinstance(h.item, CapturedStep)]
        try:
            if self._local is None:
                self._local = build_recorder(self.settings, self.policies, inline=True)
                self._local.factory = self.factory
            records = [*self._local._prepare_safely(steps), *(h.item for h in items if not isinstance(h.item, CapturedStep))]
            self.spool.append_segment([r.to_json() for r in records])
            self._spilled += len(steps)
            self.inflight.done(steps)
        except Exception as e:
            # Not spooled: keep it for the child (which retries it) and refuse new calls meanwhile.
            self.spool_error = f"{type(e).__name__}: {e}"[:300]
            log.error("could not spool %d overflow items (%s); holding them", len(items), self.spool_error)
            with self._cond:
                self._requeue(items)
        finally:
            with self._cond:
                self._spilling -= len(items)

    # --- control --------------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn()
        threading.Thread(target=self._send_loop, name="atdp-writer-send", daemon=True).start()
        threading.Thread(target=self._supervise, name="atdp-writer-supervisor", daemon=True).start()

    def connect(self, url: str, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self._db_url = url
        if self._local is not None:
            self._local.factory = factory
        self._send_control(Connect(url))

    def use_tokenizer(self, spec: str) -> None:  # keep cleaned token ids of redacted steps from now on
        self.settings = self.settings.model_copy(update={"tokenizer": spec})  # a restarted child starts with it
        self._send_control(UseTokenizer(spec))
        if self._local is not None:
            self._local.use_tokenizer(spec)

    def forget(self, tenant: str, *, step_ids: list[str] = (), content_hashes: list[str] | None = None,
               sessions: list[str] = (), whole_tenant: bool = False, forgets: list[int] = ()) -> None:
        # A lost forget is harmless (a new child's caches are empty; tombstones refuse the steps).
        msg = Forget(tenant, tuple(step_ids), tuple(content_hashes) if content_hashes is not None else None,
                     tuple(sessions), whole_tenant, tuple(forgets))
        self._send_control(msg)
        if self._local is not None:  # its caches only: the child purges the spool folder they share
            self._local.forget(tenant, step_ids=list(step_ids), content_hashes=content_hashes, forgets=list(forgets))

    def catch_up(self) -> None:  # forgets may have been missed: see Recorder.catch_up
        self._send_control(CatchUp())
        if self._local is not None:
            self._local.catch_up()

    @property
    def pending(self) -> int:
        """Items submitted but not yet durable (written or spooled)."""
        with self._cond:
            return self._held + self._spilling

    @property
    def db_ok(self) -> bool:
        return self._remote.db_ok

    @property
    def pid(self) -> int | None:
        """The running child's process id (operators, tests)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def stats(self) -> dict[str, int]:
        out = self._remote.counts()
        out["submitted"] = self.submitted
        out["spooled"] = out.get("spooled", 0) + self._spilled
        out["overflow"] = self._spilled
        out["restarts"] = self.restarts
        return out

    def refusing(self) -> str | None:
        """Why new calls must be refused (503) rather than answered and lost, or held past the
        bounds; None when they may go."""
        if self.spool_error:
            return f"the capture spool cannot be written ({self.spool_error})"
        held, size = self._held, self._held_bytes  # read without the lock: a moment stale is fine
        if size >= self._hold_limit or held >= self.settings.queue_size:
            return (f"the writer is behind: {held} answered steps ({size / 2**20:.1f} MB) wait to be stored "
                    f"(bounds: ATDP_WRITER_HOLD_MB {self.settings.writer_hold_mb:g}, "
                    f"ATDP_QUEUE_SIZE {self.settings.queue_size})")
        return None

    def health(self) -> WriterHealth:
        with self._cond:
            oldest = min((h.since for h in self._pending), default=None)
            for batch in self._unacked.values():
                if batch and (oldest is None or batch[0].since < oldest):
                    oldest = batch[0].since
            held, size = self._held + self._spilling, self._held_bytes
        # Up once the child has said it is ready (its redactor built), until it dies.
        alive = self._child_up and self._proc is not None and self._proc.is_alive()
        return WriterHealth(mode="process", alive=alive, restarts=self.restarts, held=held,
                            oldest_held_s=time.monotonic() - oldest if oldest is not None else 0.0,
                            spool_error=self.spool_error, held_bytes=size, caches=dict(self._remote.caches))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every item submitted so far is durable (acknowledged or spooled here)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._held + self._spilling > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """Drain: wait for every held item to be acknowledged, stop the child, spool what is left."""
        self._overflow.shutdown(wait=True)
        if not self.flush(timeout):
            log.warning("writer did not acknowledge %d items in %.0f s; spooling them here", self.pending, timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        proc = self._proc
        self._send_control(Stop())
        if proc is not None:
            proc.join(10.0)
            if proc.is_alive():
                log.warning("writer process did not stop; terminating it")
                proc.terminate()
                proc.join(5.0)
        if self._receiver is not None:
            self._receiver.join(2.0)  # its last acknowledgements
        with self._cond:
            left = [h for batch in self._unacked.values() for h in batch] + list(self._pending)
            self._unacked.clear()
            self._pending.clear()
            self._held = self._held_bytes = 0
            self._parts.clear()
            self._closed = True
            self._cond.notify_all()
        if left:
            with self._cond:
                self._spilling += len(left)
            self._spill(sorted(left, key=lambda h: h.seq))
            if self.pending:
                log.error("%d items could not be made durable at shutdown (%s)", self.pending, self.spool_error)
        if self._local is not None:
            self._local.redactor.close()
        self.spool.close()

    # --- the child, its pipe and its supervisor ---------------------------------------------------

    def _spawn(self) -> None:
        self._child_up = False
        inbox_r, inbox_w = self._ctx.Pipe(duplex=False)  # parent -> child
        outbox_r, outbox_w = self._ctx.Pipe(duplex=False)  # child -> parent
        proc = self._ctx.Process(target=child_main, args=(self.settings, self.policies, inbox_r, outbox_w, os.getpid()),
                                 name="atdp-writer", daemon=True)
        proc.start()
        inbox_r.close()  # only the child reads these ends: a dead child then breaks our sends at once
        outbox_w.close()
        receiver = threading.Thread(target=self._receive, args=(outbox_r,), name="atdp-writer-acks", daemon=True)
        receiver.start()
        with self._send_lock:
            if self._db_url is not None:
                inbox_w.send(Connect(self._db_url))
        with self._cond:
            self._proc, self._to_child, self._receiver = proc, inbox_w, receiver
            self._gen += 1
            self._ready = True
            self._cond.notify_all()

    def _send_control(self, msg: Control) -> None:
        """Queue a control message (connect, forget, stop) for the sender thread: callers on the event
        loop must never block on a full pipe. A child that is gone never gets it; a restarted one
        gets `Connect` from `_spawn` and has empty caches (a lost `Forget` is harmless)."""
        with self._cond:
            self._controls.append(msg)
            self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._ready and (
                        self._controls or (self._pending and time.monotonic() >= self._retry_at))):
                    self._cond.wait(0.05 if self._pending or self._controls else 1.0)
                if self._closed:
                    return
                if self._controls:
                    msg: ToChild = self._controls.popleft()
                else:
                    # A short wait lets a burst share one batch (one transaction in the child).
                    deadline = self._pending[0].since + self.settings.flush_interval_s
                    while (not self._closed and 0 < len(self._pending) < self.settings.batch_size
                           and (now := time.monotonic()) < deadline):
                        self._cond.wait(deadline - now)
                    batch = [self._pending.popleft() for _ in range(min(len(self._pending), self.settings.batch_size))]
                    if not batch:
                        continue
                    bid = next(self._bids)
                    self._unacked[bid] = batch
                    msg = Batch(bid, [h.item for h in batch])
                conn, gen = self._to_child, self._gen
            try:
                with self._send_lock:
                    if conn is None:
                        raise ValueError("no writer process")
                    conn.send(msg)
            except (OSError, ValueError):
                with self._cond:
                    # The child it was meant for is gone: the batch waits for the next one (the
                    # supervisor restarts it). A newer child may already run: leave it ready.
                    if isinstance(msg, Batch):
                        lost = self._unacked.pop(msg.id, None)
                        if lost is not None:
                            self._release(lost)
                            self._requeue(lost)
                    if gen == self._gen:
                        self._ready = False

    def _receive(self, conn: Connection) -> None:
        while True:
            try:
                msg: FromChild = conn.recv()
            except (EOFError, OSError):
                conn.close()
                return
            self._remote = msg.stats
            match msg:
                case Ready():
                    self._child_up = True
                case Ack(batch=bid):
                    with self._cond:
                        batch = self._unacked.pop(bid, None)
                        if batch is not None:
                            self._release(batch)
                        self._nacks = 0
                        self._cond.notify_all()
                    self.spool_error = None
                    if batch:
                        self.inflight.done([h.item for h in batch if isinstance(h.item, CapturedStep)])
                case Nack(batch=bid, reason=reason):
                    self.spool_error = reason
                    with self._cond:
                        batch = self._unacked.pop(bid, None)
                        if batch is not None:
                            self._release(batch)
                            self._requeue(batch)
                        self._nacks += 1
                        self._retry_at = time.monotonic() + min(5.0, 0.2 * 2 ** min(self._nacks, 5))
                        self._cond.notify_all()
                    log.error("writer could not make a batch durable (%s); holding it and retrying", reason)

    def _requeue(self, items: list[_Held]) -> None:
        """Put items back to be sent again, in submission order (caller holds _cond)."""
        self._pending = deque(sorted([*items, *self._pending], key=lambda h: h.seq))
        self._held += len(items)
        self._held_bytes += sum(h.size + self._take_parts(h.parts) for h in items)
        self._cond.notify_all()

    def _release(self, items: list[_Held]) -> None:
        """Items no longer held: acknowledged, or about to be requeued (caller holds _cond)."""
        self._held -= len(items)
        self._held_bytes -= sum(h.size + self._drop_parts(h.parts) for h in items)

    def _take_parts(self, parts: list[tuple[int, int]]) -> int:
        """Bytes the held total grows by as these shared parts are held once more (caller holds _cond):
        a part's size the first time, nothing while another held step has it."""
        grown = 0
        for pid, size in parts:
            if (entry := self._parts.get(pid)) is not None:
                entry[0] += 1
            else:
                self._parts[pid] = [1, size]
                grown += size
        return grown

    def _drop_parts(self, parts: list[tuple[int, int]]) -> int:
        """Bytes the held total shrinks by as these shared parts are held once less (caller holds _cond)."""
        shrunk = 0
        for pid, _ in parts:
            entry = self._parts[pid]
            entry[0] -= 1
            if entry[0] == 0:
                del self._parts[pid]
                shrunk += entry[1]
        return shrunk

    def _supervise(self) -> None:
        failures, started = 0, time.monotonic()
        while True:
            time.sleep(0.1)
            with self._cond:
                if self._closing:
                    return
                proc, receiver = self._proc, self._receiver
            if proc is None or proc.is_alive():
                if time.monotonic() - started > 60.0:
                    failures = 0  # it has lived a while: the next death restarts fast again
                continue
            with self._cond:
                self._ready = False
            if receiver is not None:
                receiver.join(2.0)  # take in acknowledgements the child sent before it died
            with self._cond:
                unacked = [h for batch in self._unacked.values() for h in batch]
                self._unacked.clear()
                self._release(unacked)
                self._requeue(unacked)
                old, self._to_child = self._to_child, None  # a send racing with this fails and requeues
            delay = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]
            failures += 1
            self.restarts += 1
            log.error("writer process died (exit code %s); %d items held; restarting it in %.1f s",
                      proc.exitcode, len(unacked), delay)
            with self._send_lock:
                if old is not None:
                    old.close()
            time.sleep(delay)
            with self._cond:
                if self._closing:
                    return
            try:
                self._spawn()
                started = time.monotonic()
            except Exception:
                log.exception("could not restart the writer process")
