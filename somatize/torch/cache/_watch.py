"""Watching what a module's key was taken over: ``Watch.changed`` tells cheaply, at every
call, whether the module may compute differently than when its digest was taken, so the
digest is taken again (a new name) rather than a stale value served.

    watch = Watch(module, state)          # after named_state(module)
    if watch.changed(module): ...         # digest again

What it watches: each tensor of the state by identity, version and data pointer (written
in place, replaced, or its ``.data`` swapped); each module of the tree, its class and its
own attributes by identity, containers (any dict, list, set or tuple, subclasses too) with a
shallow copy of their items; what can change under an unchanged identity (functions,
bound methods, dataclasses, containers holding more than scalars, a module of yours held
as an attribute) by its text, read again; each child's forward hooks (those with closure
cells or defaults by their text too); and the functions
of the user's classes in the tree (a method replaced mid-run: fingerprinted again).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import types
from typing import Any

import torch

from ..._reads import NAMESPACES, Unnamed, module_is_yours
from .._private import children, first_device, forward_hooks, own_tensors, versions
from ._named import _BOOKKEEPING, _named, _ours, forward_writes

# what a container may hold and still be copied shallowly (by identity): values that
# cannot change under their identity
_SCALARS = (int, float, str, bool, bytes, complex, type(None), enum.Enum)


class Watch:
    """What ``named_state`` read of a module, watched (see the module's docstring)."""

    def __init__(self, module: torch.nn.Module, state: list[tuple[str, torch.Tensor]],
                 hooks: bool = False):
        self.tensors = tuple(t for _, t in state)
        self.versions = versions(self.tensors)
        self.pointers = _pointers(self.tensors)
        self.seen = _seen(module)
        self.inner = _inner(module)  # what mutable attributes hold, by value
        # the attributes whose value can change under its identity (the only ones _inner
        # reads, while every attribute is the object it was: _same_now says so first)
        self.maybe = [(m, k, v) for m in module.modules() for k, v in m.__dict__.items()
                      if k not in _skipped(m) and not _ours(k, v) and _may_mutate(v)]
        self.hooks = [(d, tuple(d.values())) for m in module.modules()
                      if hooks or m is not module
                      for d in forward_hooks(m)]  # a child's, added or removed
        # those whose text can change under their identity (a closure over a dict)
        self.celled = [(h, "hook", h) for _, hs in self.hooks for h in hs if _has_cells(h)]
        self.cells = _inner_of(self.celled)
        self.code = _code_now(module)  # a method replaced on its class: fingerprint again
        self.device = first_device(module)  # moved (.to()): its pointers tell, set again

    def changed(self, module: torch.nn.Module) -> bool:
        """Whether the module may compute differently than when this watch was set."""
        return versions(self.tensors) != self.versions or not _same_now(
            module, self.seen) or _inner_of(self.maybe) != self.inner or not all(
            _identical(tuple(d.values()), then) for d, then in self.hooks) or not all(
            len(vars(c)) == n and all(vars(c).get(k) is f for k, f in fs)
            for c, n, fs in self.code) or _pointers(self.tensors) != self.pointers or bool(
            self.celled and _inner_of(self.celled) != self.cells)


def _has_cells(h: Any) -> bool:
    # a hook function whose closure cells or defaults may hold what changes in place
    fn = getattr(h, "__func__", h)
    return isinstance(fn, types.FunctionType) and bool(fn.__closure__ or fn.__defaults__)


def _pointers(tensors: tuple) -> list[int]:
    # ``w.data = other`` keeps the tensor and its version: where its bytes are tells
    return list(map(torch.Tensor.data_ptr, tensors))


def _code_now(module: torch.nn.Module) -> list:
    # the user's classes in the tree, with their functions by identity
    out, seen = [], set()
    for c in (k for m in module.modules() for k in type(m).__mro__):
        if c in seen or c is object or c.__module__.startswith(("torch.", "somatize.")):
            continue
        seen.add(c)
        out.append((c, len(vars(c)), [(k, f) for k, f in vars(c).items()
                                      if isinstance(f, types.FunctionType)]))
    return out


def _shallow(v: Any) -> tuple | None:
    """A container's items (a dict's keys and values), to compare by identity; None for
    anything else."""
    if isinstance(v, dict):
        return (*v, *v.values())
    if isinstance(v, (list, tuple, set, frozenset)):
        return tuple(v)
    return None


def _mutable(v: Any) -> bool:
    # what can change under an unchanged identity: its text is compared at every call
    if _may_mutate(v) and not isinstance(v, (dict, list, tuple, set, frozenset)):
        return True
    items = _shallow(v)
    return items is not None and any(not isinstance(x, _SCALARS) for x in items)


def _may_mutate(v: Any) -> bool:
    # what _mutable may say yes to (it looks at a container's content): by type alone
    return isinstance(v, (types.FunctionType, types.MethodType, functools.partial, dict,
                          list, tuple, set, frozenset, *NAMESPACES)) or (
        dataclasses.is_dataclass(v) and not isinstance(v, type)) or (
        isinstance(v, types.ModuleType) and module_is_yours(v))


def _inner(module: torch.nn.Module) -> list:
    return _inner_of([(m, k, v) for m in module.modules() for k, v in m.__dict__.items()
                      if k not in _skipped(m) and not _ours(k, v)])


def _inner_of(attrs: list) -> list:
    out = []
    for m, k, v in attrs:
        if _mutable(v):
            held: list = []  # the tensors it holds, by identity (a field rebound to another)
            try:
                out.append((id(m), k, _named(v, k, held, 0), [id(t) for _, t in held]))
            except Unnamed:
                out.append((id(m), k, None))
    return out


def _seen(module: torch.nn.Module) -> list:
    # one pass: each module, its tensors and children by identity, the names of its own
    # attributes, and those outside torch's bookkeeping with a shallow copy of the
    # containers among them
    return [(m, type(m), *own_tensors(m), children(m), frozenset(m.__dict__),
             [(k, v, _shallow(v)) for k, v in m.__dict__.items() if k not in skip])
            for m in module.modules() for skip in (_skipped(m),)]


def _same_now(module: torch.nn.Module, then: list) -> bool:
    """Whether ``_seen(module)`` would be ``then``, without making the list: the same
    root, and each module seen with the same children, is the same tree; each module with
    the same attribute names (one added or removed, bookkeeping too: the watch is set
    again) and the same objects under those it watches; each of its own class (one
    swapped in, ``m.__class__ = Other``, runs other code)."""
    if not then or then[0][0] is not module:
        return False
    for m, cls0, ps0, bs0, kids0, names0, items0 in then:
        ps, bs = own_tensors(m)
        d = m.__dict__
        if type(m) is not cls0 or not _identical(ps, ps0) or not _identical(
                bs, bs0) or not _identical(children(m), kids0) or d.keys() != names0:
            return False
        for k, v0, inner0 in items0:
            v = d[k]
            if v is not v0 or inner0 is not None and not _identical(_shallow(v), inner0):
                return False
    return True


def _skipped(m: torch.nn.Module) -> frozenset[str]:
    # torch's own attributes, and those the module's forward writes (its bookkeeping)
    written = forward_writes(type(m))
    return _BOOKKEEPING | written if written else _BOOKKEEPING


def _identical(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))  # (in C: read at every call)
