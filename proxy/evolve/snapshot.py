"""The diagnosis, kept computed: a page that shows it loads in milliseconds, not in the second or so
a diagnosis of a large window takes (docs/diagnosis.md, "Served from a snapshot").

Each (tenant, rules) the route was asked for keeps its last result with a marker of the store (the
newest step, feedback and audit ids: every write that can change a finding moves one of them).
- The marker unchanged: the snapshot is exact; it is served.
- The marker moved, the snapshot younger than `max_age_s`: it is served, marked `newer_data`, and one
  recomputation starts in the background (never two for one key).
- Older, or none: the caller waits for the recomputation (shared with any already running).
At start-up the all-tenants diagnosis with the server's rules is computed in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from proxy.evolve.rules import Rules
from proxy.store import tables as t

log = logging.getLogger("atdp.diagnosis")

Key = tuple[str | None, Rules]
Marker = tuple[str | None, str | None, int | None]
JsonDict = dict[str, object]
KEEP_KEYS = 64  # distinct (tenant, rules) snapshots kept; the least recently asked goes first


def store_marker(s: Session) -> Marker:
    """Newest step, feedback and audit ids: index-only lookups, whatever the store's size."""
    return (s.scalar(select(func.max(t.Step.id))), s.scalar(select(func.max(t.Feedback.id))),
            s.scalar(select(func.max(t.AuditEvent.id))))


@dataclass
class Snapshot:
    marker: Marker
    result: JsonDict
    computed: float  # time.monotonic() when its computation started


def _log_failure(task: asyncio.Task[Snapshot]) -> None:
    if not task.cancelled() and (e := task.exception()) is not None:
        log.warning("diagnosis could not be computed: %s", type(e).__name__)


@dataclass
class DiagnosisCache:
    max_age_s: float = 60.0
    snapshots: dict[Key, Snapshot] = field(default_factory=dict)
    running: dict[Key, asyncio.Task[Snapshot]] = field(default_factory=dict)

    async def get(self, key: Key, marker: Marker, compute: Callable[[], Awaitable[Snapshot]]) -> JsonDict:
        snap = self.snapshots.get(key)
        if snap is not None and snap.marker == marker:
            return {**snap.result, "newer_data": False}
        if snap is not None and time.monotonic() - snap.computed < self.max_age_s:
            self._start(key, compute)
            return {**snap.result, "newer_data": True}
        fresh = await asyncio.shield(self._start(key, compute))
        return {**fresh.result, "newer_data": False}

    def _start(self, key: Key, compute: Callable[[], Awaitable[Snapshot]]) -> asyncio.Task[Snapshot]:
        task = self.running.get(key)
        if task is None:
            task = asyncio.create_task(self._run(key, compute), name="atdp-diagnosis")
            task.add_done_callback(_log_failure)
            self.running[key] = task
        return task

    async def _run(self, key: Key, compute: Callable[[], Awaitable[Snapshot]]) -> Snapshot:
        try:
            snap = await compute()
            self.snapshots.pop(key, None)
            self.snapshots[key] = snap
            while len(self.snapshots) > KEEP_KEYS:
                self.snapshots.pop(next(iter(self.snapshots)))
            return snap
        finally:
            self.running.pop(key, None)
