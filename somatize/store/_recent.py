"""What this process remembers of the blobs it read: the small ones, checked, held in
memory (bounded); and the file of every blob checked, by its stat identity.

    recent.hold((root, blob), data)
    buf = recent.copy((root, blob))   # a private, 64-aligned copy, or None

    if not checked.same((root, blob), st):    # st: os.fstat of the open blob file
        ...hash it...; checked.note((root, blob), st)

A blob never changes once written, so what was read whole is served again without
opening the file or hashing it (an epoch over a cached encoder reads the same values
every epoch). A copy, because whoever gets it may write into the tensors it holds;
64-aligned, because the tensors share it and an unaligned one changes the numbers a CPU
matrix product gives.

A blob too big to hold is mapped on each read; its file, once its bytes hashed to its
name, is not hashed again while its stat identity (device, inode, size, mtime, ctime) is
the one checked: a file replaced (new inode) or written into (new ctime, which no
``utime`` can set back) is hashed again. A file changed less than ``SETTLED_NS`` before
it was checked is not remembered, since a filesystem's clock ticks coarsely (1 s on some,
2 s on FAT) and a second change within the same tick would keep the same times. Bit rot
under an unchanged stat is ``somatize store verify``'s to find.
"""

from __future__ import annotations

import os
import threading
import time
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


SETTLED_NS = 2_000_000_000  # a file's times older than this, at its check, are trusted


class Checked:
    """The stat identity of each blob file whose bytes hashed to its name (an LRU)."""

    def __init__(self, most: int):
        self.most = most
        self.items: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self.lock = threading.Lock()

    def same(self, key: tuple[str, str], st: os.stat_result) -> bool:
        """Whether the file behind ``st`` is the one checked under ``key``."""
        with self.lock:
            known = self.items.get(key)
            if known is None or known != _identity(st):
                return False
            self.items.move_to_end(key)
            return True

    def note(self, key: tuple[str, str], st: os.stat_result) -> None:
        """The file behind ``st`` was just read and its bytes hashed to its name."""
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < SETTLED_NS:
            return  # changed within a clock tick of now: the same times may not mean the same file
        with self.lock:
            self.items[key] = _identity(st)
            self.items.move_to_end(key)
            while len(self.items) > self.most:
                self.items.popitem(last=False)

    def drop(self, key: tuple[str, str]) -> None:
        with self.lock:
            self.items.pop(key, None)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


recent = Recent(256 << 20)  # one per process: every Store of the same path shares it
checked = Checked(1 << 16)  # one per process, shared like ``recent``; ~200 bytes a blob
