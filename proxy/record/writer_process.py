"""The writer in its own process, so redaction and database writes never hold the event loop's GIL.

The request path calls `WriterProcess.submit(step)`: a non-blocking put on a bounded
multiprocessing queue (a feeder thread pickles it). The child runs the same `Recorder` as the
in-process mode (redaction of distinct new content, batching writer, spool). If the queue is full
(the child is behind or gone), the step is redacted here, on a side thread, and appended to the
spool as a closed segment that the child writes back later: nothing is lost and nothing raw
reaches disk.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proxy.config import Settings
from proxy.governance.policies import Policies
from proxy.governance.redaction import RedactionConfig, TextRedactor
from proxy.governance.redaction_pool import RedactionPool
from proxy.governance.tokens import TokenGuard, load_codec, token_policy
from proxy.record.capture import CapturedStep
from proxy.record.recorder import Recorder
from proxy.record.spool import Spool

log = logging.getLogger("atdp.writer")

_STATS = ("processed", "written", "spooled", "errors", "overflow")


def build_recorder(settings: Settings, policies: Policies, *, redactor: TextRedactor | None = None,
                   inline: bool = False) -> Recorder:
    """The Recorder both modes run: redactor, tenant policies, token guard, spool."""
    if redactor is None:
        # In its own process the writer may scan inline; extra workers only pay off beyond 2 cores.
        workers = settings.redaction_workers or max(1, (os.cpu_count() or 1) - 2)
        redactor = RedactionPool(RedactionConfig(salt=settings.secret), max_workers=workers,
                                 inline_chars=200_000 if inline else 0)
    codec = load_codec(settings.tokenizer)
    return Recorder(
        secret=settings.secret, factory=None, spool=Spool(settings.spool_dir), redactor=redactor,
        policy_for=lambda s, tenant: policies.policy_for(s, tenant) if s is not None else policies.base(tenant),
        queue_size=settings.queue_size, batch_size=settings.batch_size, flush_interval_s=settings.flush_interval_s,
        token_policy=TokenGuard(codec) if codec is not None else token_policy,
    )


class _QueueView:
    def __init__(self, q) -> None:
        self._q = q

    def qsize(self) -> int:
        try:
            return self._q.qsize()
        except NotImplementedError:  # macOS
            return 0


class WriterProcess:
    """The Recorder's interface, backed by a child process."""

    def __init__(self, settings: Settings, policies: Policies) -> None:
        ctx = mp.get_context("spawn")
        self.settings = settings
        self.policies = policies
        self._q = ctx.Queue(maxsize=settings.queue_size)
        self._shared = ctx.Array("q", len(_STATS))
        self._db_ok = ctx.Value("b", 0)
        self._proc = ctx.Process(target=_child_main, args=(settings, policies, self._q, self._shared, self._db_ok, os.getpid()),
                                 name="atdp-writer", daemon=True)
        self.queue = _QueueView(self._q)
        self.spool = Spool(settings.spool_dir)
        self.factory = None
        self.submitted = 0
        self._spilled = 0
        self._overflow = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atdp-spill")
        self._local: Recorder | None = None

    # --- the request path ---------------------------------------------------------------------

    def submit(self, step: CapturedStep) -> None:
        self.submitted += 1
        try:
            self._q.put_nowait(step)
        except queue.Full:
            self._overflow.submit(self._spill, step)

    def _spill(self, step: CapturedStep) -> None:
        try:
            if self._local is None:
                self._local = build_recorder(self.settings, self.policies, inline=True)
                self._local.factory = self.factory
            records = self._local._prepare_safely([step])
            self.spool.append_segment([r.to_json() for r in records])
        except Exception:
            log.exception("could not spool an overflow step")
        finally:
            self._spilled += 1

    # --- control --------------------------------------------------------------------------------

    def start(self) -> None:
        self._proc.start()

    def connect(self, url: str, factory) -> None:
        self.factory = factory
        if self._local is not None:
            self._local.factory = factory
        self._q.put(("connect", url))

    def use_tokenizer(self, spec: str) -> None:
        self._q.put(("tokenizer", spec))
        self.settings = self.settings.model_copy(update={"tokenizer": spec})  # for a later overflow recorder
        if self._local is not None:
            self._local.use_tokenizer(spec)

    def forget(self, tenant: str, **kw: Any) -> None:
        self._q.put(("forget", tenant, kw))
        if self._local is not None:
            self._local.forget(tenant, **kw)

    @property
    def pending(self) -> int:
        """Steps submitted but not yet written or spooled."""
        return max(0, self.submitted - self._shared[0] - self._spilled)

    @property
    def db_ok(self) -> bool:
        return bool(self._db_ok.value)

    @property
    def stats(self) -> dict[str, int]:
        out = dict(zip(_STATS, self._shared[:], strict=True))
        out["submitted"] = self.submitted
        out["spooled"] += self._spilled
        out["overflow"] = self._spilled
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every step submitted so far was written or spooled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._shared[0] + self._spilled >= self.submitted:
                return True
            if not self._proc.is_alive():
                return False
            time.sleep(0.01)
        return False

    def stop(self, timeout: float = 30.0) -> None:
        self._overflow.shutdown(wait=True)
        if self._proc.is_alive():
            self._q.put(None)
            self._proc.join(timeout)
            if self._proc.is_alive():
                log.warning("writer process did not stop in %.0f s; terminating it", timeout)
                self._proc.terminate()
        self._q.close()
        if self._local is not None:
            self._local.redactor.close()


def _settle_heap(rec: Recorder) -> None:
    """Build what the writer keeps for its life (Presidio, spaCy), then take it out of the garbage
    collector's sight and collect young objects less often, as `atdp serve` does in the proxy.

    Without this the child ran on the default thresholds over an unfrozen heap of ~160K objects: a
    full collection every few hundred steps, about 0.2 ms of CPU per step written, taken from the
    proxy on a small machine. Steps are plain data freed by reference counting; cycles are rare.
    """
    if isinstance(rec.redactor, RedactionPool):
        rec.redactor.warm_up()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def _child_main(settings: Settings, policies: Policies, q, shared, db_ok, parent_pid: int) -> None:
    # Ctrl-C goes to the whole process group: the parent decides when we stop (after a flush).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("presidio-analyzer", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from proxy.store import db

    rec = build_recorder(settings, policies, inline=True)
    _settle_heap(rec)
    rec.start()
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            for i, key in enumerate(_STATS):
                shared[i] = rec.stats.get(key, 0)
            db_ok.value = 1 if rec.db_ok else 0
            time.sleep(0.005)

    threading.Thread(target=publish, name="atdp-writer-stats", daemon=True).start()
    engine = None
    while True:
        try:
            item = q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the proxy died without telling us: flush and leave
                break
            continue
        if item is None:
            break
        if isinstance(item, tuple):
            if item[0] == "connect":
                engine = db.make_engine(item[1])
                rec.connect(item[1], db.session_factory(engine))
            elif item[0] == "forget":
                rec.forget(item[1], **item[2])
            elif item[0] == "tokenizer":
                try:
                    rec.use_tokenizer(item[1])
                except Exception as e:  # an unreadable tokenizer: keep dropping ids of redacted steps
                    log.warning("could not load the tokenizer %s: %s: %s", item[1], type(e).__name__, e)
            continue
        rec.submit(item)
    rec.stop()
    stop.set()
    for i, key in enumerate(_STATS):
        shared[i] = rec.stats.get(key, 0)
    rec.redactor.close()
    if engine is not None:
        engine.dispose()
