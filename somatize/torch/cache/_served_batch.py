"""A batch's item keys, and its output where every row was served before, in one call.

    out, keys, asked = served_batch(space, x, device)  # out: None unless every row was
                                                       # served; asked: the table looked at

Where the native library is loaded (``store/_rows``), one call hashes the rows, looks
each key up in the table of items the arena served before, and copies their rows into a
fresh tensor, on two threads for a large batch: the epochs after the first. Otherwise
(or for an output that lands off the CPU), the keys alone, as ``item_keys`` gives them.
"""

from __future__ import annotations

from typing import Any

import torch

from ...store._rows import key_buffer, serve_function, split_keys
from .._codec import TORCH_DTYPES
from ._item_keys import item_keys, prepared, rows_key


def served_batch(space: Any, x: torch.Tensor,
                 device: torch.device | None) -> tuple[torch.Tensor | None, list[bytes], bool]:
    """``(out, keys, asked)``: ``out`` the batch's output when every row of ``x`` was
    served from ``space``'s arena before (else None), ``keys`` its item keys, ``asked``
    whether the served items were looked at (else ``space.served`` answers that)."""
    fn = _serve[0] if _serve else _serve.append(serve_function()) or _serve[0]
    at = space.serving() if fn is not None and (device is None or device.type == "cpu") \
        else None
    if at is not None:
        flat, sub = prepared(x)
        n, size = flat.shape[0], flat.numel() * flat.element_size()
    if at is None or not size:
        return None, item_keys(space.key, x), False  # (from x as it came: its subclass)
    x = flat
    (dtype, row), table, mask, arena, arena_rows = at
    out = torch.empty((n, *row), dtype=TORCH_DTYPES[dtype])
    keys = key_buffer(n)()
    orb = out.element_size() * (out.numel() // n)
    found = fn(x.data_ptr(), n, size // n, rows_key(space.key, x.dtype, tuple(x.shape[1:]), sub),
               keys, table or None, mask, arena, arena_rows, out.data_ptr(), orb)
    return (out if found == n and orb else None), split_keys(keys, n), bool(orb)


_serve: list = []
