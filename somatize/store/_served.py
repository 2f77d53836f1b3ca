"""The items a reader served from its arena before: item key -> its row there.

    served = Served()
    served.add(keys, rows)          # as ``Space.read`` finds rows in the arena
    codes = served.codes(keys)      # each key's row (array of int64), or None if any is not

A dict, and beside it, where the native row hasher is loaded (``_rows``), the same pairs
in a table of its library: a batch's keys are then looked up in one call (a probe of a
large dict costs a cache miss or two per key, a Python step each). Both hold the same
pairs at all times; either answers the same.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

from ._rows import table_functions

_KEY, _SLOT = 16, 24  # a slot: the key, its row + 1 (0: empty)


class Served:
    """Item key -> its row in the arena, for the items served from it."""

    def __init__(self) -> None:
        self.rows: dict[bytes, int] = {}
        self._fns = table_functions()
        self._table: bytearray | None = None
        self._at = self._mask = 0

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows.clear()
        self._table, self._at, self._mask = None, 0, 0

    def add(self, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        self.rows.update(zip(keys, rows, strict=True))
        if self._fns is None:
            return
        if self._table is None or 4 * len(self.rows) > 3 * (self._mask + 1):
            self._grow()  # made again from the dict: these with the rest
        else:
            self._put(keys, rows)

    def table(self) -> tuple[int, int]:
        """``(address, mask)`` of the native table (0, 0 where there is none)."""
        return (self._at, self._mask) if self._table is not None else (0, 0)

    def codes(self, keys: Sequence[bytes]) -> array | None:
        """The row of each of ``keys``, in order, when every one is known; else None."""
        n = len(keys)
        if self._table is not None and n:
            raw = b"".join(keys)
            if len(raw) == _KEY * n:
                out = array("q", bytes(8 * n))
                if self._fns[1](self._at, self._mask, raw, n, out.buffer_info()[0]) == n:
                    return out
                return None
        got = list(map(self.rows.get, keys))
        if not got or None in got:
            return None
        return array("q", got)

    def _grow(self) -> None:
        slots = 1024
        while slots < 2 * len(self.rows):
            slots *= 2
        self._table = bytearray(_SLOT * slots)
        self._at = ctypes.addressof(ctypes.c_char.from_buffer(self._table))
        self._mask = slots - 1
        self._put(list(self.rows), list(self.rows.values()))

    def _put(self, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        raw = b"".join(keys)
        if len(raw) != _KEY * len(keys):  # keys of another length: the dict alone
            self._fns, self._table, self._at, self._mask = None, None, 0, 0
            return
        at = array("q", rows)
        self._fns[0](self._at, self._mask, raw, at.buffer_info()[0], len(keys))
