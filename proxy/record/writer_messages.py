"""What the proxy and its writer process say to each other (`proxy.record.writer_process`): one frozen
dataclass per message, pickled over a multiprocessing pipe, matched by type on either side.

The parent sends `Batch` (answered steps to make durable) and the control messages; the child
answers every batch with `Ack` (durable: committed or fsync'd to the spool) or `Nack` (held by the
parent and retried), says `Ready` once its redactor is built and `Idle` while nothing arrives. Every
answer carries the child's `WriterStats`, which is all the parent knows of its counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.record.durability import Item
from proxy.record.recorder import Recorder

# -- parent -> child -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Connect:
    url: str  # the database; a restarted child gets it again first


@dataclass(frozen=True)
class UseTokenizer:
    spec: str  # keep cleaned token ids of redacted steps from now on


@dataclass(frozen=True)
class Forget:
    """What a forget drops from the writer's memory and spool: `Recorder.forget`'s arguments."""

    tenant: str
    step_ids: tuple[str, ...] = ()
    content_hashes: tuple[str, ...] | None = None  # None: every content of the tenant
    sessions: tuple[str, ...] = ()
    whole_tenant: bool = False
    forgets: tuple[int, ...] = ()  # the forgets' counts (proxy.store.forgets)

    def apply(self, rec: Recorder) -> None:
        rec.forget(self.tenant, step_ids=list(self.step_ids),
                   content_hashes=list(self.content_hashes) if self.content_hashes is not None else None,
                   sessions=list(self.sessions), whole_tenant=self.whole_tenant, forgets=list(self.forgets))


@dataclass(frozen=True)
class CatchUp:
    """Forgets may have been missed (see `Recorder.catch_up`)."""


@dataclass(frozen=True)
class Stop:
    """Every batch is acknowledged: close the spool and exit."""


@dataclass(frozen=True)
class Batch:
    id: int
    items: list[Item]


Control = Connect | UseTokenizer | Forget | CatchUp | Stop
ToChild = Control | Batch

# -- child -> parent -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WriterStats:
    """The child's counters and bounded caches, as of its message."""

    processed: int = 0
    written: int = 0
    spooled: int = 0
    errors: int = 0
    adopted: int = 0
    db_ok: bool = False
    caches: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, rec: Recorder) -> WriterStats:
        s = rec.stats
        return cls(processed=s.get("processed", 0), written=s.get("written", 0), spooled=s.get("spooled", 0),
                   errors=s.get("errors", 0), adopted=s.get("adopted", 0), db_ok=rec.db_ok,
                   caches=rec.preparer.cache_sizes())

    def counts(self) -> dict[str, int]:
        return {"processed": self.processed, "written": self.written, "spooled": self.spooled,
                "errors": self.errors, "adopted": self.adopted}


@dataclass(frozen=True)
class Ready:
    stats: WriterStats  # the redactor is built: steps are taken now


@dataclass(frozen=True)
class Idle:
    stats: WriterStats  # nothing arrived for a retry interval (the spool was drained meanwhile)


@dataclass(frozen=True)
class Ack:
    batch: int
    stats: WriterStats


@dataclass(frozen=True)
class Nack:
    batch: int
    reason: str  # db.db_error_reason: never row values
    stats: WriterStats


FromChild = Ready | Idle | Ack | Nack
