"""What a placed module's call and its answer carry, and how their structure travels:
the tensors apart (TensorPipe sends them beside the pickle), the rest pickled, with a
marker where each tensor stood; arguments that are distinct tensors only, and an output
that is one tensor or a tuple of distinct tensors, travel with no pickled structure.

    tensors, plain = pack(flat); flat == unpack(tensors, plain)
    blob = dumps(obj)     # classes the script defines travel by value
"""

from __future__ import annotations

import pickle
from typing import Any

import torch


class TensorHere:
    """Marks, among a structure's plain leaves, where a tensor stood (it travels apart)."""


class Same:
    """An argument tensor the forward left as it was: the caller's own tensor ``i`` (a
    leaf to the walker, not a dataclass it would walk into)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def pack(flat: list) -> tuple[list, list]:
    """The tensors of ``flat``, and its other leaves with ``TensorHere`` in their place."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    return tensors, [TensorHere if isinstance(t, torch.Tensor) else t for t in flat]


def unpack(tensors: Any, plain: list) -> list:
    it = iter(tensors)
    return [next(it) if p is TensorHere else p for p in plain]


def plain_args(args: tuple, kwargs: dict) -> tuple | None:
    """``(len(args), kwargs' names)`` when every argument is a tensor and no tensor
    stands twice: the call needs no pickled structure. Else None."""
    n = len(args)
    if not all(isinstance(a, torch.Tensor) for a in args) or not all(
            isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    ids = {id(a) for a in args}
    ids.update(id(v) for v in kwargs.values())
    return (n, tuple(kwargs)) if len(ids) == n + len(kwargs) else None


def plain_out(out: Any) -> int | None:
    """How an answer's structure travels when the output is one tensor (``None``) or a
    tuple of ``n`` distinct tensors (``n``); else ``-1`` (pickled)."""
    if isinstance(out, torch.Tensor):
        return None
    if type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out) \
            and len({id(t) for t in out}) == len(out):
        return len(out)
    return -1


def dumps(obj: Any) -> bytes:
    """Classes and functions defined in the script (``__main__``) by value."""
    try:  # the plain pickler is several times faster: used where nothing is __main__'s
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in blob:
            return blob
    except Exception:
        pass
    import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

