"""What tests/remote_shm_runs.py runs on its worker (imported there by reference, so what
it holds stays there between calls)."""

from __future__ import annotations

import torch

from somatize.remote import _shm

held: list = []


def looks(t: torch.Tensor) -> tuple:
    """What a tensor that crossed is: its type, dtype, shape, strides, grad flag, storage
    (bytes, offset), whether it is a view, conjugate."""
    if t.layout != torch.strided:
        return type(t).__name__, t.dtype, tuple(t.shape), str(t.layout), t._nnz()
    return (type(t).__name__, t.dtype, tuple(t.shape), t.stride(), t.requires_grad,
            t.untyped_storage().nbytes(), t.storage_offset(), t._base is None, t.is_conj())


def switch(live, on: bool) -> None:
    _shm.enable(on)


def back(live, t):
    return looks(t), t, _shm.sent[0]


def total(live, t) -> float:
    return float(t.sum())


def hold(live, t) -> None:
    held.append(t)


def held_total(live) -> float:
    return float(held[0].sum())


def let_go(live) -> None:
    held.clear()


def slots(live) -> int:
    return len(_shm._slots) if _shm.enabled() else -1


def sent(live) -> int:
    return _shm.sent[0]
