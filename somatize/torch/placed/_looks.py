"""How a value looks now, to tell later, by ``==``, whether it changed in place: a list
appended to, a dict's entry set, a tensor written into (its version counter), an
object's attribute set (a ``DynamicCache``'s layers, a config's field). What cannot
change in place (a number, a string, a function, an ``Enum``) looks like itself or its
identity, so a look never runs a user's ``__eq__`` and never reads a tensor's values.

    was = looks(value); ...; changed = looks(value) != was
    if mutable(value): ...          # whether a look can tell more than its identity
"""

from __future__ import annotations

import enum
import functools
import types
from typing import Any

import torch

from .._private import version

_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
_BY_ID = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
          types.ModuleType, enum.Enum, torch.nn.Module, range)
_DEPTH = 6  # deeper than this, a value is told by its identity


def _ndarray() -> Any:
    import sys

    np = sys.modules.get("numpy")  # (imported only if the user's code uses it)
    return np.ndarray if np is not None else ()


def looks(v: Any, depth: int = 0) -> Any:
    """What ``v`` looks like now: atoms, identities and version counters only."""
    t = type(v)
    if t in _ATOMS:
        return v
    if isinstance(v, torch.Tensor):
        return (id(v), version(v), tuple(v.shape))
    if depth > _DEPTH or isinstance(v, _BY_ID):
        return id(v)
    if t is tuple or t is list or isinstance(v, (tuple, list)):
        return (id(v), t, tuple(looks(x, depth + 1) for x in v), _attrs(v, depth))
    if isinstance(v, dict):
        return (id(v), t, tuple((k, looks(x, depth + 1)) for k, x in v.items()),
                _attrs(v, depth))
    if isinstance(v, (set, frozenset)):
        return (id(v), t, frozenset(looks(x, depth + 1) for x in v))
    if isinstance(v, bytearray):
        return (id(v), bytes(v))
    if isinstance(v, functools.partial):
        return (id(v), id(v.func), looks(v.args, depth + 1), looks(v.keywords, depth + 1))
    if isinstance(v, _ndarray()):
        return (id(v), v.dtype.str, v.shape, v.tobytes())
    if hasattr(v, "__dict__") or hasattr(type(v), "__slots__"):
        return (id(v), t, _attrs(v, depth))
    return id(v)  # a numpy scalar, a C object: changed only by being replaced


def _attrs(v: Any, depth: int) -> tuple:
    d = getattr(v, "__dict__", None)
    if d is None:
        slots = [s for c in type(v).__mro__ for s in c.__dict__.get("__slots__", ())
                 if isinstance(s, str)] if not isinstance(v, (tuple, list, dict)) else ()
        return tuple((s, looks(getattr(v, s, None), depth + 1)) for s in slots)
    return tuple((k, looks(x, depth + 1)) for k, x in d.items())


def mutable(v: Any) -> bool:
    """Whether ``v`` can change in place in a way its identity does not tell."""
    if type(v) in _ATOMS or isinstance(v, _BY_ID):
        return False
    if type(v) is tuple:
        return any(mutable(x) for x in v)
    return not (isinstance(v, _ATOMS) or type(looks(v)) is int)
