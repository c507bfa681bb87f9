"""The writer child's side of `proxy.record.writer_process`: the Recorder it runs, and its main loop
(receive a batch, make it durable, acknowledge it; the messages are `proxy.record.writer_messages`)."""

from __future__ import annotations

import gc
import logging
import os
import signal
from multiprocessing.connection import Connection

from proxy import logs, memtrace
from proxy.config import Settings, spool_folders
from proxy.governance.policies import Policies
from proxy.governance.redaction import RedactionConfig, TextRedactor
from proxy.governance.redaction_pool import RedactionPool
from proxy.governance.tokens import TokenGuard, load_codec, token_policy
from proxy.record.recorder import CacheSizes, Recorder
from proxy.record.spool import Spool, adoptable, held
from proxy.record.writer_messages import (
    Ack,
    Batch,
    CatchUp,
    Connect,
    Forget,
    Idle,
    Nack,
    Ready,
    Stop,
    ToChild,
    UseTokenizer,
    WriterStats,
)

log = logging.getLogger("atdp.writer")

def build_recorder(settings: Settings, policies: Policies, *, redactor: TextRedactor | None = None,
                   inline: bool = False) -> Recorder:
    """The Recorder both modes run: redactor, tenant policies, token guard, spool."""
    if redactor is None:
        # In its own process the writer may scan inline; extra workers only pay off beyond 2 cores.
        workers = settings.redaction_workers or max(1, (os.cpu_count() or 1) - 2)
        redactor = RedactionPool(RedactionConfig(salt=settings.secret, ner_model=settings.ner_model), max_workers=workers,
                                 inline_chars=200_000 if inline else 0)
    codec = load_codec(settings.tokenizer)
    # Other processes' spool folders, looked for at each look (replicas come and go); none unless
    # this process holds its own (proxy.record.spool.adoptable).
    orphans = None
    if settings.spool_adopt_s > 0 and held(settings.spool_dir):
        orphans = lambda: adoptable(spool_folders(settings.home), settings.spool_dir)  # noqa: E731
    return Recorder(
        secret=settings.secret, factory=None, spool=Spool(settings.spool_dir), redactor=redactor,
        policy_for=lambda s, tenant: policies.policy_for(s, tenant) if s is not None else policies.base(tenant),
        queue_size=settings.queue_size, batch_size=settings.batch_size, flush_interval_s=settings.flush_interval_s,
        token_policy=TokenGuard(codec) if codec is not None else token_policy,
        caches=CacheSizes(settings.writer_cache_entries, settings.token_cache_tokens, settings.token_cache_s),
        orphans=orphans, adopt_interval_s=settings.spool_adopt_s)


def _settle_heap(rec: Recorder) -> None:
    """Build what the writer keeps for its life (Presidio, spaCy), freeze it out of the collector's
    sight and collect young objects less often, as `atdp serve` does: on default thresholds over ~160K
    objects, full collections cost about 0.2 ms of CPU per step, taken from the proxy on small machines."""
    if isinstance(rec.redactor, RedactionPool):
        rec.redactor.warm_up()
    else:
        rec.redactor.redact_many([("atdp", "warm up")])
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def child_main(settings: Settings, policies: Policies, inbox: Connection, outbox: Connection, parent_pid: int) -> None:
    # Ctrl-C and SIGTERM go to the whole process group: the parent decides when we stop, after it
    # has every batch acknowledged. A file-size limit must be an OSError (EFBIG) here, not a death.
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGXFSZ", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    logs.configure(quiet=("presidio-analyzer", "alembic"))  # one line per record, no credentials in URLs
    from proxy.store import db

    rec = build_recorder(settings, policies, inline=True)
    # Build the redactor (Presidio: seconds) before saying ready, not inside the first batch: the
    # health check shows the writer down until then, and the first steps are not held that long.
    _settle_heap(rec)
    memtrace.start("writer", settings.malloc_trim_s)  # glibc heap upkeep; snapshots when asked
    engine = None
    try:
        outbox.send(Ready(WriterStats.of(rec)))
        while True:
            if not inbox.poll(rec.retry_interval_s):
                if os.getppid() != parent_pid:  # the proxy died without telling us
                    break
                rec.drain_spool()
                outbox.send(Idle(WriterStats.of(rec)))
                continue
            try:
                msg: ToChild = inbox.recv()
            except (EOFError, OSError):
                break
            match msg:
                case Batch(id=bid, items=items):
                    try:
                        rec.persist_now(items)
                    except Exception as e:
                        rec.stats["errors"] += 1
                        outbox.send(Nack(bid, db.db_error_reason(e), WriterStats.of(rec)))  # no row values
                    else:
                        outbox.send(Ack(bid, WriterStats.of(rec)))
                case Connect(url=url):
                    if engine is not None:
                        engine.dispose()
                    engine = db.make_engine(url, custom_plans=True)  # every statement names its sessions
                    rec.connect(url, db.session_factory(engine))
                case Forget():
                    msg.apply(rec)
                case CatchUp():
                    rec.catch_up()
                case UseTokenizer(spec=spec):
                    try:
                        rec.use_tokenizer(spec)
                    except Exception as e:  # an unreadable tokenizer: keep dropping ids of redacted steps
                        log.warning("could not load the tokenizer %s: %s: %s", spec, type(e).__name__, e)
                case Stop():
                    break
    except (BrokenPipeError, EOFError):
        pass  # the parent is gone; everything we acknowledged is durable already
    finally:
        rec.spool.close()
        rec.redactor.close()
        if engine is not None:
            engine.dispose()
