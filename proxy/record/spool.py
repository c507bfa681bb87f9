"""An append-only, fsync'd local spool of redacted step records, for when PostgreSQL is away.

Records go to segment files named by creation time (`<ns>-<pid>.jsonl`). Appends fsync before returning, so a
record acknowledged to the spool survives a crash. Draining rotates to a fresh segment first, then
replays closed segments oldest first and deletes each only after its records are committed.
Replays are safe to repeat: the store ignores step ids it already has.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson


class Spool:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._lock = threading.Lock()
        self._fh = None
        self._current: Path | None = None

    def segments(self) -> list[Path]:
        return sorted(self.dir.glob("*.jsonl"))

    def _next_path(self) -> Path:
        # Named by creation time and process: several processes may add segments (the writer, and
        # the proxy when its queue overflows); replay order is creation order.
        return self.dir / f"{time.time_ns():020d}-{os.getpid()}.jsonl"

    def append_segment(self, records: list[dict]) -> None:
        """Write records as one closed segment, atomically (temp file, fsync, rename)."""
        if not records:
            return
        data = b"".join(orjson.dumps(r, option=orjson.OPT_NAIVE_UTC) + b"\n" for r in records)
        final = self._next_path()
        tmp = final.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def append(self, records: list[dict]) -> None:
        if not records:
            return
        data = b"".join(orjson.dumps(r, option=orjson.OPT_NAIVE_UTC) + b"\n" for r in records)
        with self._lock:
            if self._fh is None:
                self._current = self._next_path()
                fd = os.open(self._current, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._fh = os.fdopen(fd, "ab")
            self._fh.write(data)
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def reject(self, records: list[dict], *, reason: str) -> None:
        """Set records the database refused aside (same redacted form), with the reason, for an operator."""
        folder = self.dir / "rejected"
        folder.mkdir(exist_ok=True, mode=0o700)
        path = folder / f"{time.time_ns():020d}-{os.getpid()}.jsonl"
        data = b"".join(orjson.dumps({"reason": reason, "record": r}, option=orjson.OPT_NAIVE_UTC) + b"\n"
                        for r in records)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def pending(self) -> bool:
        return bool(self.segments())

    def count(self) -> int:
        return sum(1 for p in self.segments() for line in p.read_bytes().splitlines() if line.strip())

    def _rotate(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
                self._current = None

    def drain(self, write: Callable[[list[dict]], None], batch: int = 256) -> int:
        """Replay every closed segment through `write` (which raises on failure). Returns records replayed."""
        self._rotate()
        done = 0
        for path in self.segments():
            with self._lock:
                if path == self._current:  # appended to since the rotate: leave it for next time
                    break
            lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()]
            records = []
            for ln in lines:
                try:
                    records.append(orjson.loads(ln))
                except orjson.JSONDecodeError:
                    continue  # a torn final line from a crash mid-append: the step was never acknowledged
            for i in range(0, len(records), batch):
                write(records[i : i + batch])
            path.unlink()
            done += len(records)
        return done

    def close(self) -> None:
        self._rotate()
