"""What both writers (in-process thread, child process) share: the `Writer` interface the proxy
holds them by, and, to keep "nothing lost" checkable, the ids of steps answered but not yet durable
and the writer's health as `/healthz` and `/metrics` report it.

A step is *durable* once it is committed to PostgreSQL or fsync'd to the spool. Until then the
proxy holds it (and re-sends or spools it if the writer dies); feedback for it waits for it instead
of answering 404.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from proxy.record.capture import CapturedStep
from proxy.store.write import SealedResponse

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from proxy.record.spool import Spool

Item = CapturedStep | SealedResponse  # what a writer takes: captured steps, sealed /v1/responses conversations


class Writer(Protocol):
    """What the proxy asks of its writer: `proxy.record.recorder.Recorder` (a thread in this process)
    and `proxy.record.writer_process.WriterProcess` (a supervised child, the default) both are one."""

    inflight: InFlight
    spool: Spool

    def submit(self, item: Item) -> None: ...  # never blocks, never touches disk
    def start(self) -> None: ...
    def connect(self, url: str, factory: sessionmaker[Session]) -> None: ...
    def use_tokenizer(self, spec: str) -> None: ...
    def forget(self, tenant: str, *, step_ids: list[str] = ..., content_hashes: list[str] | None = ...,
               sessions: list[str] = ..., whole_tenant: bool = ..., forgets: list[int] = ...) -> None: ...
    def catch_up(self) -> None: ...
    def refusing(self) -> str | None: ...  # why new calls must get 503 now, or None
    def health(self) -> WriterHealth: ...
    def flush(self, timeout: float = ...) -> bool: ...
    def stop(self, timeout: float = ...) -> None: ...
    @property
    def pending(self) -> int: ...
    @property
    def db_ok(self) -> bool: ...
    @property
    def stats(self) -> dict[str, int]: ...


class InFlight:
    """Session and step ids of held (answered, not yet durable) steps."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sessions: Counter[str] = Counter()
        self._steps: set[str] = set()

    def add(self, step: CapturedStep) -> None:
        with self._cond:
            self._sessions[step.session.external_id] += 1
            self._steps.add(step.step_id)

    def done(self, steps: Iterable[CapturedStep]) -> None:
        with self._cond:
            for st in steps:
                if st.step_id not in self._steps:
                    continue  # a re-sent batch acknowledged twice
                self._steps.discard(st.step_id)
                self._sessions[st.session.external_id] -= 1
                if self._sessions[st.session.external_id] <= 0:
                    del self._sessions[st.session.external_id]
            self._cond.notify_all()

    def holds(self, session_id: str, step_id: str | None = None) -> bool:
        with self._cond:
            return (step_id in self._steps) if step_id is not None else session_id in self._sessions

    def wait(self, session_id: str, step_id: str | None, timeout: float) -> bool:
        """Block until the session's (or the step's) held steps are durable; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (step_id in self._steps) if step_id is not None else session_id in self._sessions:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


@dataclass
class WriterHealth:
    """The writer as health and metrics show it. `problems` empty means ok."""

    mode: str  # process | thread
    alive: bool
    restarts: int
    held: int  # steps (and stored responses) answered but not yet durable
    oldest_held_s: float  # age of the oldest of them
    spool_error: str | None  # the last spool failure while it lasts (disk full): new calls get 503
    held_bytes: int = 0  # what the held steps cost (process mode: bounded by ATDP_WRITER_HOLD_MB)
    problems: list[str] = field(default_factory=list)
    caches: dict[str, int] = field(default_factory=dict)  # the writer's bounded caches: entries each

    def judge(self, lag_limit_s: float) -> WriterHealth:
        if not self.alive:
            self.problems.append("writer is down (starting or restarting)")
        if self.spool_error:
            self.problems.append(f"spool cannot be written: {self.spool_error}")
        if self.held and self.oldest_held_s > lag_limit_s:
            self.problems.append(f"writer is lagging: {self.held} steps held, oldest {self.oldest_held_s:.0f} s")
        return self

    def as_json(self) -> dict[str, object]:
        return {"mode": self.mode, "alive": self.alive, "restarts": self.restarts, "held": self.held,
                "held_mb": round(self.held_bytes / 2**20, 3),
                "oldest_held_s": round(self.oldest_held_s, 3), "spool_error": self.spool_error,
                "problems": self.problems, "caches": self.caches}
