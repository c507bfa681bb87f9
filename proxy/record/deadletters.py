"""Dead letters: step records the database refused, set aside in the spool's `rejected/` folder.

The recorder puts a record here only when PostgreSQL refuses it for its *content* even alone (see
`Recorder._write`); the doors validate ids and shapes first, so a call answered 200 should never end
here. When one still does, it must not be invisible or outlive governance: `atdp deadletters
list|replay|purge` reads, retries and deletes them, forget purges a forgotten session's (or
tenant's), and retention expires them like stored steps.

Each file holds JSON lines `{"reason": str, "record": StepRecord JSON}`; records are redacted (the
spool's form). Files are rewritten atomically (temp file, fsync, rename) when some of their lines go;
the recorder only ever creates new files, so a rewrite never races an append.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from proxy.record.spool import adopted

FOLDER = "rejected"


@dataclass(frozen=True)
class DeadLetter:
    file: Path
    reason: str
    record: dict[str, Any]

    @property
    def step_id(self) -> str:
        return str(self.record.get("id", ""))

    @property
    def tenant(self) -> str:
        return str((self.record.get("session") or {}).get("tenant_id", ""))

    @property
    def session(self) -> str:
        return str((self.record.get("session") or {}).get("external_id", ""))

    @property
    def started_at(self) -> datetime | None:
        return _time(self.record.get("started_at"))

    @property
    def retention_until(self) -> datetime | None:
        return _time(self.record.get("retention_until"))

    def summary(self) -> dict[str, Any]:
        """What `atdp deadletters list` shows: ids, status and why; never content."""
        return {"step_id": self.step_id, "tenant": self.tenant, "session": self.session,
                "api": self.record.get("api"), "status": self.record.get("status"),
                "started_at": self.started_at.isoformat() if self.started_at else None,
                "reason": self.reason, "file": self.file.name}


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def folder(spool_dir: Path) -> Path:
    return spool_dir / FOLDER


def read(spool_dir: Path) -> list[DeadLetter]:
    """Every dead letter, oldest file first. A torn line (a crash mid-write) is skipped."""
    out: list[DeadLetter] = []
    for path in sorted(folder(spool_dir).glob("*.jsonl")):
        out.extend(_read_file(path))
    return out


def _read_file(path: Path) -> list[DeadLetter]:
    out = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("record"), dict):
            out.append(DeadLetter(file=path, reason=str(entry.get("reason", "")), record=entry["record"]))
    return out


def _rewrite(path: Path, keep: list[DeadLetter]) -> None:
    """Replace a file by the letters it keeps (deleted when none), atomically."""
    if not keep:
        path.unlink(missing_ok=True)
        return
    data = b"".join(orjson.dumps({"reason": d.reason, "record": d.record}, option=orjson.OPT_NAIVE_UTC) + b"\n"
                    for d in keep)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def purge(spool_dir: Path, drop: Callable[[DeadLetter], bool], others: Iterable[Path] = ()) -> list[DeadLetter]:
    """Delete the dead letters `drop` selects; returns them. `others`: spool folders of other processes
    (proxy.record.spool.adoptable), each purged while no live process holds it (its holder purges its
    own), held meanwhile: a replica scaled away leaves its dead letters to the ones that remain."""
    dropped: list[DeadLetter] = []
    for path in sorted(folder(spool_dir).glob("*.jsonl")):
        letters = _read_file(path)
        gone = [d for d in letters if drop(d)]
        if gone:
            _rewrite(path, [d for d in letters if not drop(d)])
            dropped.extend(gone)
    for other in others:
        with adopted(other) as spool:
            if spool is not None:
                dropped += purge(other, drop)
    return dropped


def purge_session(spool_dir: Path, session: str, tenant: str | None, others: Iterable[Path] = ()) -> list[DeadLetter]:
    """Forget: a session's dead letters (by its public id; `tenant` None = any tenant)."""
    return purge(spool_dir, lambda d: d.session == session and (tenant is None or d.tenant == tenant), others)


def purge_tenant(spool_dir: Path, tenant: str, others: Iterable[Path] = ()) -> list[DeadLetter]:
    return purge(spool_dir, lambda d: d.tenant == tenant, others)


def purge_expired(spool_dir: Path, retention_days: Callable[[str], int | None],
                  now: datetime | None = None, others: Iterable[Path] = ()) -> list[DeadLetter]:
    """Retention: a dead letter past its record's `retention_until`, or older than its tenant's
    `retention_days` now, goes (like the steps `forget.run_retention` deletes)."""
    now = now or datetime.now(UTC)
    days_of: dict[str, int | None] = {}

    def expired(d: DeadLetter) -> bool:
        if d.retention_until is not None and d.retention_until < now:
            return True
        if d.tenant not in days_of:
            days_of[d.tenant] = retention_days(d.tenant)
        days = days_of[d.tenant]
        return bool(days) and d.started_at is not None and d.started_at < now - timedelta(days=days)

    return purge(spool_dir, expired, others)


@dataclass
class Replayed:
    written: list[str]  # step ids now in the database (and gone from the folder)
    failed: list[tuple[str, str]]  # (step id, why) still set aside


def replay(spool_dir: Path, write: Callable[[dict[str, Any]], None],
           letters: Iterable[DeadLetter] | None = None) -> Replayed:
    """Write dead letters again, one at a time (`write` raises when the database still refuses one);
    those written leave the folder. For after the cause is fixed (a migration, a widened column)."""
    chosen = list(read(spool_dir) if letters is None else letters)
    done: set[tuple[Path, str]] = set()
    out = Replayed(written=[], failed=[])
    for d in chosen:
        try:
            write(d.record)
        except Exception as e:
            out.failed.append((d.step_id, type(e).__name__))
            continue
        done.add((d.file, d.step_id))
        out.written.append(d.step_id)
    if done:
        purge(spool_dir, lambda d: (d.file, d.step_id) in done)
    return out
