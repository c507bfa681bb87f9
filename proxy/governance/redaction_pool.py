"""Parallel redaction: distinct contents spread across worker processes, each with its own Redactor."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from proxy.governance.redaction import RedactionConfig, Redactor

_worker: Redactor | None = None


def _init_worker(config: RedactionConfig, parent_pid: int | None = None) -> None:
    global _worker
    # SIGINT/SIGTERM reach the whole process group (Ctrl-C, systemd): the process that owns this pool
    # decides when it ends (after its writer has drained), so a worker must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent_pid is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="atdp-orphan-watch", daemon=True).start()
    _worker = Redactor(config)


def _exit_when_orphaned(parent_pid: int) -> None:
    """A pool whose owner was killed (-9) cannot shut its workers down: they leave by themselves."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _redact_chunk(items: list[tuple[str, Any]], with_values: bool = False,
                  operator: list[bool] | None = None) -> list[tuple]:
    assert _worker is not None
    return _worker.redact_many(items, with_values=with_values, operator=operator)


def _text_size(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0


class _Done:
    def __init__(self, value: list[tuple[Any, dict[str, int]]]) -> None:
        self._value = value

    def result(self) -> list[tuple[Any, dict[str, int]]]:
        return self._value


class PendingRedaction:
    """Results of `RedactionPool.submit_many`, in input order once `result()` returns."""

    def __init__(self, chunks: list[list[int]], futures: list[Any]) -> None:
        self._chunks = chunks
        self._futures = futures

    def result(self) -> list[tuple[Any, dict[str, int]]]:
        out: list[Any] = [None] * sum(len(c) for c in self._chunks)
        for chunk, fut in zip(self._chunks, self._futures, strict=True):
            for i, res in zip(chunk, fut.result(), strict=True):
                out[i] = res
        return out


class RedactionPool:
    """`redact_value` over many distinct contents, spread across worker processes.

    Workers are spawned (not forked: the proxy runs threads and an event loop) and each builds its own
    `Redactor` from the config once. Batches smaller than `inline_chars` of text are done in the
    calling process, where shipping them to a worker would cost more than the scan.
    """

    def __init__(
        self,
        config: RedactionConfig | None = None,
        max_workers: int | None = None,
        *,
        inline_chars: int = 2_000,
        mp_context: str = "spawn",
    ) -> None:
        import multiprocessing

        self.config = config or RedactionConfig()
        self.max_workers = max_workers or os.cpu_count() or 1
        self.inline_chars = inline_chars
        self._local: Redactor | None = None
        self._executor: ProcessPoolExecutor | None = None
        if self.max_workers > 1:
            self._executor = ProcessPoolExecutor(
                max_workers=self.max_workers,
                mp_context=multiprocessing.get_context(mp_context),
                initializer=_init_worker,
                initargs=(self.config, os.getpid()),
            )

    @property
    def local(self) -> Redactor:
        if self._local is None:
            self._local = Redactor(self.config)
        return self._local

    def warm_up(self) -> None:
        """Build the redactors now (each imports Presidio, about a second) rather than on first use: the
        in-process one that small batches use, and every worker."""
        if self.inline_chars > 0 or self._executor is None:
            # One scan loads what recognizers load on first use (phone number metadata, regexes).
            self.local.analyze("warm-up: ada@example.com, +1 415 555 0134, https://example.com/x")
        if self._executor is not None:
            list(self._executor.map(_redact_chunk, [[] for _ in range(self.max_workers)]))

    def redact_many(self, items: list[tuple[str, Any]], *, with_values: bool = False,
                    operator: Sequence[bool] | None = None) -> list[tuple]:
        """As `Redactor.redact_many`, spread over the workers."""
        return self.submit_many(items, with_values=with_values, operator=operator).result()

    def submit_many(self, items: list[tuple[str, Any]], *, with_values: bool = False,
                    operator: Sequence[bool] | None = None) -> PendingRedaction:
        """Like `redact_many` but returns at once; `.result()` waits. Lets a writer hash and queue the
        next batch while this one is scanned."""
        if not items:
            return PendingRedaction([], [])
        sizes = [_text_size(v) for _, v in items] if self._executor is not None and len(items) > 1 else []
        if not sizes or sum(sizes) < self.inline_chars:
            done = self.local.redact_many(items, with_values=with_values, operator=operator)
            return PendingRedaction([list(range(len(items)))], [_Done(done)])
        # Balance by text size, not item count: one 40 KB tool result must not sit with ten others.
        n = min(self.max_workers * 2, len(items))
        chunks: list[list[int]] = [[] for _ in range(n)]
        loads = [0] * n
        for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
            j = loads.index(min(loads))
            chunks[j].append(i)
            loads[j] += sizes[i] + 200  # per-item overhead
        chunks = [c for c in chunks if c]
        futures = [
            self._executor.submit(_redact_chunk, [items[i] for i in c], with_values,
                                  [bool(operator[i]) for i in c] if operator is not None else None)
            for c in chunks
        ]
        return PendingRedaction(chunks, futures)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> RedactionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
