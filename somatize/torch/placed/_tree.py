"""The one walker of nested arguments and outputs: the tensors and plain values out of
their structure, and the structure back around them, every container its own type.

Tuples, lists and dicts, namedtuples and ``torch.return_types``, dict and list
subclasses (transformers' ``ModelOutput``), dataclasses (``init=False`` fields and
attributes set later included), instances of plain classes (state in ``__dict__``, no
pickling of their own: a KV cache): each is rebuilt as the same class, without running its
``__init__`` or ``__post_init__`` again (what they set is read back as it was). A tensor
that stands in two places (a ``ModelOutput``'s item and attribute) is one leaf, so both
places get the same tensor back. Anything else is a leaf: it travels as it is.

    flat, spec = tree_flatten((args, kwargs))
    args, kwargs = tree_unflatten(flat, spec)     # same types, flat's values in place
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch


class _Slot(int):
    """Where the i-th leaf of a structure stood."""


def tree_flatten(obj: Any) -> tuple[list, Any]:
    """The leaves of a nested structure (a tensor seen twice once), and its shape (which
    pickles; classes defined in ``__main__`` travel by value with cloudpickle)."""
    flat: list = []
    seen: dict[int, _Slot] = {}

    def leaf(o):
        if isinstance(o, torch.Tensor):
            slot = seen.get(id(o))
            if slot is None:
                slot = seen[id(o)] = _Slot(len(flat))
                flat.append(o)
            return slot
        flat.append(o)
        return _Slot(len(flat) - 1)

    def split(o):
        t = type(o)
        if t is tuple or t is list:
            return (t.__name__, [split(v) for v in o])
        if t is dict:
            return ("dict", list(o), [split(v) for v in o.values()])
        if isinstance(o, torch.Tensor) or isinstance(o, (str, bytes, torch.Size)):
            return leaf(o)
        if isinstance(o, tuple):
            if hasattr(o, "_fields"):  # a namedtuple
                return ("nt", t, [split(v) for v in o])
            if hasattr(t, "n_fields"):  # a structseq: torch.return_types.max
                return ("seq", t, [split(v) for v in o])
            return leaf(o)
        if isinstance(o, dict):  # a defaultdict keeps its factory (a slot, not state)
            return ("map", t, list(o), [split(v) for v in o.values()], _state(o, split),
                    getattr(o, "default_factory", None))
        if isinstance(o, list):
            return ("list+", t, [split(v) for v in o], _state(o, split))
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return ("obj", t, _state(o, split))
        if _plain_object(o):  # a cache object (a KV cache): its tensors travel as tensors
            return ("obj", t, _state(o, split))
        return leaf(o)

    return flat, split(obj)


def _plain_object(o: Any) -> bool:
    # an instance of a plain class: its state is its __dict__ (no pickling of its own)
    t = type(o)
    return (hasattr(o, "__dict__") and not isinstance(o, (type, torch.nn.Module))
            and t.__reduce_ex__ is object.__reduce_ex__ and t.__reduce__ is object.__reduce__
            and getattr(t, "__getstate__", object.__getstate__) is object.__getstate__
            and not callable(o) and t.__module__ != "builtins")


def _state(o: Any, split) -> list:
    # the instance's attributes as they are (fields, init=False ones, set later), walked
    if hasattr(o, "__dict__"):
        names = list(vars(o))
    elif dataclasses.is_dataclass(o):  # __slots__ (a dataclass(slots=True))
        names = [f.name for f in dataclasses.fields(o) if hasattr(o, f.name)]
    else:  # a builtin's instance (a defaultdict): no attributes of its own
        return []
    values = vars(o) if hasattr(o, "__dict__") else {n: getattr(o, n) for n in names}
    return [(n, split(values[n])) for n in names]


def tree_unflatten(flat: list, shape: Any) -> Any:
    """The structure ``tree_flatten`` read, with ``flat``'s values in place."""
    if isinstance(shape, _Slot):
        return flat[shape]
    kind = shape[0]
    if kind == "tuple":
        return tuple(tree_unflatten(flat, v) for v in shape[1])
    if kind == "list":
        return [tree_unflatten(flat, v) for v in shape[1]]
    if kind == "dict":
        return dict(zip(shape[1], [tree_unflatten(flat, v) for v in shape[2]], strict=True))
    if kind == "nt":
        return shape[1]._make(tree_unflatten(flat, v) for v in shape[2])
    if kind == "seq":
        return shape[1]([tree_unflatten(flat, v) for v in shape[2]])
    cls = shape[1]
    new = cls.__new__(cls)  # neither __init__ nor __post_init__: the state is set as read
    if kind == "map":
        base = collections.OrderedDict if issubclass(cls, collections.OrderedDict) else dict
        for k, v in zip(shape[2], shape[3], strict=True):
            base.__setitem__(new, k, tree_unflatten(flat, v))
        _restore(new, flat, shape[4])
        if shape[5] is not None:
            new.default_factory = shape[5]
    elif kind == "list+":
        list.extend(new, [tree_unflatten(flat, v) for v in shape[2]])
        _restore(new, flat, shape[3])
    else:  # "obj": a dataclass
        _restore(new, flat, shape[2])
    return new


def _restore(new: Any, flat: list, state: list) -> None:
    into = getattr(new, "__dict__", None)  # set directly: no __setattr__ of theirs runs
    for name, v in state:
        if into is not None:
            into[name] = tree_unflatten(flat, v)
        else:
            object.__setattr__(new, name, tree_unflatten(flat, v))  # frozen, __slots__
