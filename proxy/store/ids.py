"""Time-sortable ids (UUIDv7, RFC 9562): ordering by id is ordering by creation time."""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_seq = 0


def uuid7() -> uuid.UUID:
    """A UUIDv7; monotonic within this process (a 12-bit counter breaks ties inside one millisecond)."""
    global _last_ms, _seq
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            _seq += 1
            if _seq > 0xFFF:  # counter exhausted: borrow the next millisecond
                _last_ms += 1
                _seq = 0
            ms = _last_ms
        else:
            _last_ms, _seq = ms, 0
        seq = _seq
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (seq << 64) | (0b10 << 62) | rand
    return uuid.UUID(int=value)


def new_id() -> str:
    return str(uuid7())


def uuid7_at(when_ms: int) -> str:
    """A UUIDv7 for a given millisecond (random bits, no ordering within it): an id minted then, as
    an import of older sessions or a test of day partitions needs."""
    rand = int.from_bytes(os.urandom(10), "big")
    value = (when_ms << 80) | (0x7 << 76) | ((rand >> 64) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return str(uuid.UUID(int=value))
