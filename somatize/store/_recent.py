"""The blobs read last, checked, held in memory (bounded): a blob never changes once
written, so what was read whole is served again without opening the file or hashing it
(an epoch over a cached encoder reads the same values every epoch).

    recent.hold((root, blob), data)
    buf = recent.copy((root, blob))   # a private, 64-aligned copy, or None

A copy, because whoever gets it may write into the tensors it holds; 64-aligned, because
the tensors share it and an unaligned one changes the numbers a CPU matrix product gives.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .._packing import aligned


class Recent:
    """An LRU of blob bytes under a byte budget; a blob over an eighth of it is not held."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.items: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self.lock = threading.Lock()

    def copy(self, key: tuple[str, str]) -> memoryview | None:
        """A private, 64-aligned copy of what is held under ``key``, or None."""
        with self.lock:
            data = self.items.get(key)
            if data is None:
                return None
            self.items.move_to_end(key)
        buf = aligned(len(data))
        buf[:] = data
        return buf

    def hold(self, key: tuple[str, str], data: bytes) -> None:
        if len(data) > self.budget // 8:
            return
        with self.lock:
            if key in self.items:
                return
            self.items[key] = data
            self.used += len(data)
            while self.used > self.budget:
                _, old = self.items.popitem(last=False)
                self.used -= len(old)

    def drop(self, key: tuple[str, str]) -> None:
        with self.lock:
            data = self.items.pop(key, None)
            if data is not None:
                self.used -= len(data)


recent = Recent(256 << 20)  # one per process: every Store of the same path shares it
