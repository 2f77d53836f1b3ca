"""The module-level names a placed module's code reads, kept the same over there.

The worker holds its own copy of them: the values its classes were sent with (a script's
classes travel by value) or those its own import gave it. What they hold here is sent
with the first call, and again whenever one is rebound (``GAIN = 2.0`` by a callback) or,
a small dict, list, set or tuple of plain values, changed in place (``CFG["gain"] = 2``):
the worker sets them where its copy of the code reads them. A config object of plain
fields (a dataclass's instance, a ``SimpleNamespace``, ``argparse.Namespace``) is sent as
its fields, and they are set on the worker's own copy of it. A name rebound here to what
cannot travel as data (a function, another object) is refused, naming it.

    watch = Watched(module)                   # when the module is placed
    ops.append(SetGlobals(watch.changes("encoder", "worker")))   # at every call, if any
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import types
from dataclasses import dataclass
from typing import Any

import torch

from ..._bytecode import DYNAMIC, loaded_globals
from ..._errors import Refused
from ..._keys import functions_of
from ..._reads import yours

_MISSING = object()
_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_LIBRARY = ("torch", "somatize", "lightning", "builtins")


class Watched:
    """What ``module``'s code reads of its modules' globals, as last sent over there."""

    def __init__(self, module: Any):
        self.refs = _references(module)  # (who reads it, its globals, the name, module)
        self.values = self._now()
        self.copies = _copies(self.values)
        self.sent = False
        self.first = False  # whether the last changes() were the first call's

    def _now(self) -> list:
        return [g.get(name, _MISSING) for _, g, name, _ in self.refs]

    def changes(self, name: str, host: str) -> tuple:
        """``(its module, the name, its value)`` of each one to set over there: every
        plain one at the first call, then those rebound or changed in place."""
        if not self.refs:
            return ()
        now = self._now()
        if self.sent and all(map(operator.is_, now, self.values)) and all(
                _as_sent(now[i]) == then for i, then in self.copies):  # (as they were)
            return ()
        first, self.sent = not self.sent, True
        self.first = first
        out = []
        copied = dict(self.copies)
        for i, ((who, _, global_name, where), v, then) in enumerate(
                zip(self.refs, now, self.values, strict=True)):
            if v is _MISSING or (not first and v is then and (
                    i not in copied or _as_sent(v) == copied[i])):
                continue
            if _data(v) or _record(v):
                out.append((where, global_name, _copy(v)))
            elif not first:  # rebound here to code or an object: it cannot follow as data
                raise Refused(
                    f"{who} reads the global {global_name!r}, which was set here to a "
                    f"{type(v).__name__} after {name!r} was placed on worker {host!r}: the "
                    f"worker has its own copy, and only plain data (numbers, strings, small "
                    f"dicts, lists, tuples of them) is sent to it when changed. Make it an "
                    f"attribute of the module (attributes set here travel), or leave "
                    f"{name!r} unplaced")
        self.values, self.copies = now, _copies(now)
        return tuple(out)


@dataclass(frozen=True)
class SetGlobals:
    """The globals to set over there, where the placed module's code reads them."""

    values: tuple  # (the module of the code that reads it, the name, the value)
    first: bool = False  # sent with the first call since the module (or a child) was sent

    def apply(self, placed: Any) -> None:
        self.apply_to(placed.module, placed.__dict__)

    def apply_to(self, code: Any, holder: dict) -> None:
        """Set them where ``code``'s copy over there reads them (``holder``: where to keep
        what that is found to be, between calls)."""
        where = holder.get("global_refs")
        if where is None or self.first:  # its code's globals over there, as here
            where = holder["global_refs"] = {}
            for _, g, name, module in _references(code):
                where.setdefault((module, name), []).append(g)
        for module, name, value in self.values:
            for g in where.get((module, name), ()):  # each copy of that module's globals
                if isinstance(value, Fields):  # a config object: its copy there, set in place
                    value.set_on(g.get(name), name)
                else:
                    g[name] = _copy(value)


class Fields(dict):
    """A config object's fields (a dataclass's, a namespace's), sent by value: set in place
    on the worker's own copy of the object (its class need not travel)."""

    def set_on(self, obj: Any, name: str) -> None:
        if obj is None or not _record(obj) or set(_fields(obj)) != set(self):
            raise Refused(
                f"the global {name!r} is a config object here with fields {sorted(self)}, "
                f"but over there it is {type(obj).__name__}"
                f"{' with fields ' + str(sorted(_fields(obj))) if _record(obj) else ''}: the "
                "worker imported another version of the code. Run the same code on both")
        for k, v in self.items():
            object.__setattr__(obj, k, _copy(v))  # (a frozen dataclass too)


def _data(v: Any) -> bool:
    # what is sent by value: a plain value, or a small container of them (a config)
    if type(v) in _SCALARS:
        return True
    if type(v) is dict:
        items = [*v.keys(), *v.values()]
    elif type(v) in (list, set, tuple, frozenset):
        items = list(v)
    else:
        return False
    return len(items) <= 128 and all(type(x) in _SCALARS for x in items)


def _record(v: Any) -> bool:
    # a config object of plain fields (a dataclass's instance, a namespace): sent as them
    if not (dataclasses.is_dataclass(v) and not isinstance(v, type)
            or type(v) in (types.SimpleNamespace, argparse.Namespace)):
        return False
    fields = _fields(v)
    return len(fields) <= 128 and all(_data(x) for x in fields.values())


def _fields(v: Any) -> dict:
    if dataclasses.is_dataclass(v):
        return {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
    return dict(vars(v))


def _copy(v: Any) -> Any:
    if type(v) in (dict, list, set):
        return type(v)(v)
    return Fields({k: _copy(x) for k, x in _fields(v).items()}) if _record(v) else v


def _as_sent(v: Any) -> Any:
    # what to compare with its copy: a config object as its fields, a container as it is
    return _copy(v) if _record(v) else v


def _copies(values: list) -> list:
    # the mutable plain containers and config objects among them, copied: one changed in
    # place is seen
    return [(i, _copy(v)) for i, v in enumerate(values)
            if type(v) in (dict, list, set) and _data(v) or _record(v)]


def _classes(obj: Any) -> list[type]:
    """The classes whose code runs when ``obj`` runs: a module's and its modules'; a graph
    node's, those of what it holds that runs (modules, nodes: a trainer's node) too."""
    out: dict[type, None] = {}
    todo, seen = [(obj, 0)], set()
    while todo:
        o, depth = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.nn.Module):
            out.update(dict.fromkeys(type(m) for m in o.modules()))
            continue
        out[type(o)] = None
        if depth < 2:
            todo += [(v, depth + 1) for v in getattr(o, "__dict__", {}).values()
                     if isinstance(v, torch.nn.Module) or callable(getattr(v, "forward", None))
                     and not isinstance(v, type)]
    return list(out)


def _references(module: Any) -> list[tuple[str, dict, str, str]]:
    """``(who reads it, its globals, the name, the code's module)`` for each global the
    code of ``module``'s classes of yours loads (a placed module's, or a graph node's:
    ``_classes``), and of the functions of yours it calls."""
    refs: dict[tuple[int, str], tuple[str, dict, str, str]] = {}
    classes = _classes(module)
    todo = functions_of(classes, _LIBRARY)
    seen: set[int] = set()
    while todo:
        who, fn = todo.pop(0)
        if id(fn.__code__) in seen or not yours(fn.__code__):
            continue
        seen.add(id(fn.__code__))
        g = fn.__globals__
        for name in sorted({n for n, _ in loaded_globals(fn.__code__) if n != DYNAMIC}):
            refs.setdefault((id(g), name), (who, g, name, fn.__module__ or ""))
            v = g.get(name)
            if isinstance(v, types.FunctionType):  # a helper it calls: what it reads too
                todo.append((f"{v.__qualname__} (called by {who})", v))
    return list(refs.values())
