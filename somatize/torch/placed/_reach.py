"""What a hook on a placed module's child can reach outside its module: the objects its
closure holds, the globals it names, the object it is a method of. The child runs over
there, so a hook that writes into one of them writes into the worker's copy (refused at
the call that does it), and one that reads this process's context (a ``ContextVar``,
held itself or by an object it names: Hugging Face's ``_active_collector``) would read
the worker's: those variables are carried, their values here set over there around
each call and what the hooks changed in them brought back (``_here``, ``_there``).

    reach(hook)       # [("features", {}), ...]: what a look before and after compares
    contexts(hook)    # [ContextVar("collector")]: context variables it reads
"""

from __future__ import annotations

import contextvars
import functools
import types
from typing import Any

import torch

from ._looks import mutable


def _parts(fn: Any) -> tuple[Any, list]:
    # the plain function under partials and bound methods, and what they hold
    held = []
    while isinstance(fn, functools.partial):
        held += [("a partial's argument", a) for a in (*fn.args, *fn.keywords.values())]
        fn = fn.func
    if isinstance(fn, types.MethodType):
        if not isinstance(fn.__self__, torch.nn.Module):
            held.append((f"{type(fn.__self__).__name__} instance", fn.__self__))
        fn = fn.__func__
    elif not isinstance(fn, types.FunctionType) and callable(fn):
        held.append((f"{type(fn).__name__} instance", fn))
        fn = type(fn).__call__
    return fn, held


def _named(fn: Any) -> list:
    fn, held = _parts(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return held
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            held.append((name, cell.cell_contents))
        except ValueError:  # a cell not filled yet
            pass
    args = code.co_varnames[:code.co_argcount]
    held += list(zip(args[len(args) - len(fn.__defaults__ or ()):], fn.__defaults__ or (),
                     strict=True))
    held += list((fn.__kwdefaults__ or {}).items())
    g = getattr(fn, "__globals__", {})
    held += [(n, g[n]) for n in code.co_names if n in g]
    return held


def reach(fn: Any) -> list:
    """``(name, object)`` for each object outside its module that ``fn`` may write into."""
    return [(n, v) for n, v in _named(fn)
            if not isinstance(v, torch.nn.Module) and mutable(v)]


def contexts(fn: Any) -> list[contextvars.ContextVar]:
    """The context variables ``fn`` reads: named by it, or held by an object it names."""
    found = []
    for _, v in _named(fn):
        held = [v] if isinstance(v, contextvars.ContextVar) else [
            x for x in (getattr(v, "__dict__", None) or {}).values()
            if isinstance(x, contextvars.ContextVar)] if not isinstance(v, type) else []
        found += [x for x in held if all(x is not y for y in found)]
    return found


def described(fn: Any) -> str:
    """The hook as the user wrote it: its name, file and line."""
    base, _ = _parts(fn)
    code = getattr(base, "__code__", None)
    name = getattr(base, "__qualname__", type(fn).__name__)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code else name
