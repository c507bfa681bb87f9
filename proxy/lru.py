"""A bounded mapping that forgets its least recently written entries (the caches of the writer and
the token guard)."""

from __future__ import annotations

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
