"""A bounded mapping that forgets its least recently written entries (the caches of the writer and
the token guard)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(OrderedDict[K, V]):
    def __init__(self, max_items: int) -> None:
        super().__init__()
        self.max_items = max_items

    def put(self, key: K, value: V) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.max_items:
            self.popitem(last=False)


_HEX = frozenset("0123456789abcdef")


def id_key(value: str) -> bytes | str:
    """A UUID id as its 16 bytes (a 49-byte object against 85 for its text); any other id as it is.
    Cache keys that live by the hundred thousand. Only the canonical form (lowercase, 8-4-4-4-12, as
    `str(uuid.UUID(...))` writes it) is packed, so two spellings of one UUID stay two keys."""
    if len(value) != 36 or value[8] != "-" or value[13] != "-" or value[18] != "-" or value[23] != "-":
        return value
    digits = value[:8] + value[9:13] + value[14:18] + value[19:23] + value[24:]
    if not _HEX.issuperset(digits):
        return value
    return bytes.fromhex(digits)


def content_key(tenant: str, content_hash: str) -> bytes:
    """(tenant, content hash) as one 16-byte digest, against a tuple and a 64-character hex string."""
    return hashlib.blake2b(f"{tenant}\0{content_hash}".encode(), digest_size=16).digest()
