"""The module-level names a placed module's code reads, watched here.

The worker holds its own copy of them: the values its classes were sent with (a script's
classes travel by value) or those its own import gave it. One rebound here after the
module was sent (``GAIN = 2.0`` by a callback, a helper function swapped) would not be
seen over there, so the call that comes after it is refused, naming the name and where
it is read.

    watch = Watched(module)      # when the module is placed: what its code reads, now
    watch.check("encoder", "worker")   # at every call: Refused if one was rebound

Rebinding is seen (a number, a string, a function given a new value), and a small dict,
list or set of plain values changed in place; other objects changed in place are not
(docs/lightning.md).
"""

from __future__ import annotations

import dis
import operator
import types
from typing import Any

from ..._errors import Refused
from ..._reads import yours

_MISSING = object()
_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_LIBRARY = ("torch", "somatize", "lightning", "builtins")


class Watched:
    """What ``module``'s code reads of its modules' globals, as it is now."""

    def __init__(self, module: Any):
        self.refs = _references(module)  # (who reads it, its globals, the name)
        self.values = self._now()
        # plain containers (CFG = {"gain": 1.0}): a copy, to see one changed in place
        self.copies = [(i, _copy(v)) for i, v in enumerate(self.values) if _plain(v)]

    def _now(self) -> list:
        return [g.get(name, _MISSING) for _, g, name in self.refs]

    def check(self, name: str, host: str) -> None:
        """Refuse a call after one of the names was rebound here (to another value)."""
        if not self.refs:
            return
        now = self._now()
        if all(map(operator.is_, now, self.values)):  # (at C speed: the same objects)
            for i, then in self.copies:
                if now[i] != then:
                    who, _, global_name = self.refs[i]
                    raise Refused(
                        f"{who} reads the global {global_name!r}, changed in place here to "
                        f"{_shown(now[i])} (it was {_shown(then)} when {name!r} was placed on "
                        f"worker {host!r}): the worker has its own copy and would not see the "
                        f"change. Make it an attribute of the module (attributes set here "
                        f"travel), or leave {name!r} unplaced")
            return
        for (who, _, global_name), v, then in zip(self.refs, now, self.values, strict=True):
            if v is then or (type(v) is type(then) and isinstance(v, _SCALARS) and v == then):
                continue
            raise Refused(
                f"{who} reads the global {global_name!r}, which was set here to "
                f"{_shown(v)} (it was {_shown(then)} when {name!r} was placed on worker "
                f"{host!r}): the worker has its own copy and would not see the change. "
                f"Make it an attribute of the module (self.{global_name.lower()} = ...: "
                f"attributes set here travel), or leave {name!r} unplaced")
        self.values = now  # set again to what it was: the same from now on
        self.copies = [(i, _copy(v)) for i, v in enumerate(now) if _plain(v)]


def _plain(v: Any) -> bool:
    # a small dict, list or set of plain values (a config): compared by value each call
    if type(v) is dict:
        items = [*v.keys(), *v.values()]
    elif type(v) in (list, set):
        items = list(v)
    else:
        return False
    return len(items) <= 128 and all(type(x) in _SCALARS for x in items)


def _copy(v: Any) -> Any:
    return type(v)(v)


def _shown(v: Any) -> str:
    if v is _MISSING:
        return "nothing"
    text = repr(v) if isinstance(v, _SCALARS) or _plain(v) else f"a {type(v).__name__}"
    return text if len(text) < 60 else text[:57] + "..."


def _references(module: Any) -> list[tuple[str, dict, str]]:
    refs: dict[tuple[int, str], tuple[str, dict, str]] = {}
    todo: list[tuple[str, types.FunctionType]] = []
    for m in module.modules():
        for cls in type(m).__mro__:
            if (cls.__module__ or "").startswith(_LIBRARY):
                continue
            for k, v in vars(cls).items():
                for f in _functions(v):
                    todo.append((f"{cls.__qualname__}.{k}", f))
    seen: set[int] = set()
    while todo:
        who, fn = todo.pop()
        if id(fn.__code__) in seen or not yours(fn.__code__):
            continue
        seen.add(id(fn.__code__))
        g = fn.__globals__
        for name in _loaded(fn.__code__):
            refs.setdefault((id(g), name), (who, g, name))
            v = g.get(name)
            if isinstance(v, types.FunctionType):  # a helper it calls: what it reads too
                todo.append((f"{v.__qualname__} (called by {who})", v))
    return list(refs.values())


def _functions(v: Any) -> list:
    v = getattr(v, "__func__", v)  # staticmethod, classmethod
    if isinstance(v, property):
        return [f for f in (v.fget, v.fset) if isinstance(f, types.FunctionType)]
    return [v] if isinstance(v, types.FunctionType) else []


def _loaded(code: types.CodeType) -> set[str]:
    names = {ins.argval for ins in dis.get_instructions(code)
             if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for c in code.co_consts:  # comprehensions, lambdas, nested functions
        if isinstance(c, types.CodeType):
            names |= _loaded(c)
    return {n for n in names if isinstance(n, str)}
