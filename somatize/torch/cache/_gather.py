"""Served rows into a batch's output: rows of the reader's arena, in the batch's order.

    gather(result, rows, torch.float32)   # result[i] = arena row rows.codes[i]

One native call where the library of ``store/_rows`` is loaded (two threads for a large
batch), else one ``index_select``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...store._rows import gather_function


def gather(result: torch.Tensor, rows: Any, dtype: torch.dtype) -> None:
    """Fill ``result`` with rows served from the arena (``rows.codes``: the row of each
    slot there): one native call, else one ``index_select``."""
    if result.device.type == "cpu" and _native(result, rows):
        return
    at = torch.frombuffer(rows.codes, dtype=torch.int64)
    src = torch.frombuffer(rows.arena, dtype=torch.uint8).view(dtype).view(-1, *rows.row)
    if result.device.type == "cpu":
        torch.index_select(src, 0, at, out=result)
    else:
        result.copy_(src.index_select(0, at))


def _native(result: torch.Tensor, rows: Any) -> bool:
    """``gather`` in one native call (two threads for a large batch); False where it
    cannot be had (then index_select does it)."""
    fn = _gather_fn[0] if _gather_fn else _gather_fn.append(gather_function()) or _gather_fn[0]
    rb = result.element_size() * (result.numel() // max(result.shape[0], 1))
    if fn is None or rb == 0 or not result.is_contiguous():
        return False
    src = torch.frombuffer(rows.arena, dtype=torch.uint8)  # no copy: where its bytes are
    at, n = rows.codes.buffer_info()
    return n == result.shape[0] and fn(result.data_ptr(), src.data_ptr(), src.numel() // rb,
                                       at, n, rb) == 0


_gather_fn: list = []
