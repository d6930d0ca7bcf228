"""A least-recently-used memo of fixed size for the twin's per-step caches.

Why bounded: `headroom serve --backend twin` runs for days, and every distinct allocator state, step
shape or decode batch size would otherwise stay cached forever. A miss only costs a recomputation (tens
of microseconds), so a memo that forgets the oldest entries is always correct.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUMemo(Generic[K, V]):
    """At most `maxsize` entries; a hit makes its entry the newest, an insert past the size drops the oldest."""

    def __init__(self, maxsize: int) -> None:
        if maxsize <= 0:
            raise ValueError("maxsize must be positive")
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)
        return value

    def clear(self) -> None:
        self._data.clear()
