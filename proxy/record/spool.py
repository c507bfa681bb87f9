"""An append-only, fsync'd local spool of redacted step records, for when PostgreSQL is away.

Records go to segment files named by creation time (`<ns>-<pid>.jsonl`). Appends fsync before returning, so a
record acknowledged to the spool survives a crash; a new segment's directory entry is fsync'd too.
An append that fails (disk full: ENOSPC, EFBIG, any OSError) cuts the segment back to where it was
and raises: the caller keeps the records and the spool never holds a half-written line it wrote.
Draining rotates to a fresh segment first, then replays closed segments oldest first and deletes
each only after its records are committed. A line that does not parse (torn by a crash mid-append
or by the disk) is moved to `quarantine/`, never silently skipped. Replays are safe to repeat: the
store ignores step ids it already has.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson

log = logging.getLogger("atdp.spool")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a nearly full disk): loop, or raise."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write to the spool")
        view = view[n:]


def claim_folder(folder_of: Callable[[int], Path], first: int, *, limit: int = 1024) -> tuple[int, int]:
    """(K, fd): the spool folder `folder_of(K)` (proxy.config.spool_folder) that this process now
    holds, `first` if no live process holds it, else the lowest free one. Held by an exclusive flock
    on the folder's `.owner` until the process exits (keep `fd` open): a spool is drained by the
    process that appends to it, and two on one folder would lose records (one deletes a segment the
    other still appends to). The replicas of `docker compose up --scale proxy=N` share one home
    volume, each with worker index 0: each gets a folder of its own, and a replica that starts later
    takes over a folder its predecessor left, with whatever it had not drained."""
    for k in dict.fromkeys([first, *range(limit)]):
        folder = folder_of(k)
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / ".owner", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return k, fd
    raise RuntimeError(f"every one of {limit} spool folders ({folder_of(0)}, ...) is held by a live process")


def held(folder: Path) -> bool:
    """Whether a live process holds `folder` (claim_folder's lock on its `.owner`)."""
    with adopted(folder, create=False) as spool:
        return spool is None and (folder / ".owner").exists()


def adoptable(folders: list[Path], own: Path) -> list[Path]:
    """Of `folders` (proxy.config.spool_folders), those this process may take while no live process
    holds them: every other one when it holds `own` itself (a process of `atdp serve`: claim_folder);
    none otherwise, as an embedding that holds no folder (create_app alone) cannot tell a stopped
    process's folder from that of a running one that holds none either."""
    return [f for f in folders if f != own] if held(own) else []


@contextlib.contextmanager
def adopted(folder: Path, *, create: bool = True) -> Iterator[Spool | None]:
    """The spool in `folder`, held for the block as claim_folder holds one, if no live process holds
    it; None if one does (or, without `create`, if it has no `.owner`). A replica scaled away for good
    leaves its folder unheld, with whatever it had not drained: another replica's writer takes the
    folder a moment, drains it and lets it go (Recorder.adopt)."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = os.open(folder / ".owner", flags, 0o600)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield Spool(folder)
    finally:
        os.close(fd)  # the lock goes with it


class Spool:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._current: Path | None = None
        self.quarantined = 0  # lines moved to quarantine/ by this process

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
            _write_all(fd, data)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)
        _fsync_dir(self.dir)

    def append(self, records: list[dict]) -> None:
        """Append records durably (fsync'd) or raise OSError with the segment as it was before."""
        if not records:
            return
        data = b"".join(orjson.dumps(r, option=orjson.OPT_NAIVE_UTC) + b"\n" for r in records)
        with self._lock:
            if self._fd is None:
                self._current = self._next_path()
                self._fd = os.open(self._current, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                try:
                    _fsync_dir(self.dir)  # the new segment's name must survive a crash too
                except OSError:
                    self._close_current()
                    raise
            start = os.fstat(self._fd).st_size
            try:
                _write_all(self._fd, data)
                os.fsync(self._fd)
            except OSError:
                # Leave no torn line behind for the next append to continue: cut back, and start
                # the next append in a fresh segment.
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                    os.fsync(self._fd)
                empty, path = start == 0, self._current
                self._close_current()
                if empty and path is not None:  # retries must not leave a trail of empty segments
                    with contextlib.suppress(OSError):
                        path.unlink()
                raise

    def _close_current(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = None
        self._current = None

    def reject(self, records: list[dict], *, reason: str) -> None:
        """Set records the database refused aside (same redacted form), with the reason, for an operator."""
        folder = self.dir / "rejected"
        folder.mkdir(exist_ok=True, mode=0o700)
        path = folder / f"{time.time_ns():020d}-{os.getpid()}.jsonl"
        data = b"".join(orjson.dumps({"reason": reason, "record": r}, option=orjson.OPT_NAIVE_UTC) + b"\n"
                        for r in records)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def pending(self) -> bool:
        return bool(self.segments())

    def count(self) -> int:
        return sum(1 for p in self.segments() for line in p.read_bytes().splitlines() if line.strip())

    def _rotate(self) -> None:
        with self._lock:
            self._close_current()

    def quarantine(self, segment: Path, lines: list[bytes]) -> Path:
        """Keep lines that do not parse beside the spool (same redacted bytes), for an operator."""
        folder = self.dir / "quarantine"
        folder.mkdir(exist_ok=True, mode=0o700)
        path = folder / (segment.stem + ".torn")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            _write_all(fd, b"".join(ln + b"\n" for ln in lines))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(folder)
        self.quarantined += len(lines)
        return path

    def drain(self, write: Callable[[list[dict]], None], batch: int = 256, limit: int | None = None) -> int:
        """Replay every closed segment through `write` (which raises on failure), or whole segments until
        `limit` records are replayed. Returns records replayed."""
        self._rotate()
        done = 0
        for path in self.segments():
            if limit is not None and done >= limit:
                break
            with self._lock:
                if path == self._current:  # appended to since the rotate: leave it for next time
                    break
            lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()]
            records, torn = [], []
            for ln in lines:
                try:
                    rec = orjson.loads(ln)
                except orjson.JSONDecodeError:
                    rec = None
                if isinstance(rec, dict):
                    records.append(rec)
                else:  # torn by a crash or the disk mid-append: set aside, never silently dropped
                    torn.append(ln)
            for i in range(0, len(records), batch):
                write(records[i : i + batch])
            if torn:
                where = self.quarantine(path, torn)
                log.warning("spool segment %s: %d torn line(s) moved to %s", path.name, len(torn), where)
            path.unlink()
            done += len(records)
        return done

    def purge(self, drop: Callable[[dict], bool]) -> int:
        """Remove pending records `drop` selects (a forgotten session's), rewriting each closed
        segment atomically (temp file, fsync, rename). Returns how many went. A drain racing this
        may still replay a dropped record; the store's tombstones refuse it (proxy.store.write)."""
        self._rotate()
        gone = 0
        for path in self.segments():
            with self._lock:
                if path == self._current:
                    continue
            try:
                lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()]
            except FileNotFoundError:  # drained meanwhile
                continue
            keep = []
            for ln in lines:
                try:
                    rec = orjson.loads(ln)
                except orjson.JSONDecodeError:
                    rec = None
                if isinstance(rec, dict) and drop(rec):
                    continue
                keep.append(ln)  # torn lines stay for the drain to quarantine
            if len(keep) == len(lines):
                continue
            gone += len(lines) - len(keep)
            if not keep:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            tmp = path.with_suffix(".purge")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, b"".join(ln + b"\n" for ln in keep))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        if gone:
            _fsync_dir(self.dir)
        return gone

    def close(self) -> None:
        self._rotate()
