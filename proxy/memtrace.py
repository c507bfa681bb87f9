"""Memory upkeep of a long-lived process: glibc's free heap handed back, and (for a soak's
diagnosis) heap snapshots over time.

`trim`: every `malloc_trim_s` seconds (a setting; 0: off) `malloc_trim(0)` returns the free pages
of glibc's heaps to the system. Python's small objects live in its own arenas, but request bodies,
parsed JSON and token arrays are glibc allocations; after a burst (a lagging writer, a PostgreSQL
outage: thousands of steps held) their freed space otherwise stays in the process's RSS.

Snapshots (off unless `ATDP_TRACEMALLOC_DIR` is set; never for production: tracemalloc roughly
doubles the cost of every allocation and a snapshot holds the GIL for a moment): each process
writes `<dir>/<role>-<pid>-<n>.snap` every `ATDP_TRACEMALLOC_EVERY_S` seconds (60 by default), and
`bench/memdiff.py` compares them. Snapshots hold file names, line numbers and sizes, no values.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
import tracemalloc
from pathlib import Path

log = logging.getLogger("atdp.memory")


def rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def start(role: str, trim_s: float = 0.0) -> None:
    """Start the trim loop (`trim_s` > 0, glibc only) and, with `ATDP_TRACEMALLOC_DIR`, snapshots."""
    trim = _malloc_trim() if trim_s > 0 else None
    if trim is not None:
        threading.Thread(target=_trim_loop, args=(role, trim, trim_s), name="atdp-malloc-trim", daemon=True).start()
    folder = os.environ.get("ATDP_TRACEMALLOC_DIR")
    if not folder:
        return
    every = float(os.environ.get("ATDP_TRACEMALLOC_EVERY_S", "60"))
    frames = int(os.environ.get("ATDP_TRACEMALLOC_FRAMES", "1"))
    Path(folder).mkdir(parents=True, exist_ok=True)
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    threading.Thread(target=_snapshot_loop, args=(Path(folder), role, every), name="atdp-memtrace",
                     daemon=True).start()


def _trim_loop(role: str, trim: ctypes._CFuncPtr, every: float) -> None:
    while True:
        time.sleep(every)
        before = rss_mb()
        trim(0)
        after = rss_mb()
        if before is not None and after is not None and before - after >= 1.0:
            log.info("%s: malloc_trim returned %.1f MB (RSS %.1f -> %.1f MB)", role, before - after, before, after)


def _snapshot_loop(folder: Path, role: str, every: float) -> None:
    pid, n = os.getpid(), 0
    while True:
        time.sleep(every)
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        snap.dump(str(folder / f"{role}-{pid}-{n:04d}.snap"))
        n += 1
