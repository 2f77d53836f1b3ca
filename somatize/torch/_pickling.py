"""How somatize pickles what it sends to a worker (a function to call, a call's
structure, a node that does not pickle plainly): plainly where nothing in it is the
script's, by value (cloudpickle) where something is: a class or function defined in
``__main__``, a lambda, a local function. Code sent by value keeps its file name, so a
traceback over there names the user's file and line (cloudpickle writes
``<dynamic-code>``). A ``ContextVar`` (which pickles in no way of its own) travels as
the worker's stand-in for it, one per variable here (``stand_in``): whatever sent reads
it, over there, reads the one variable that a call sets to the value it has here.

    blob = dumps(obj)                         # pickle.loads(blob) over there
    by_value()(buf, protocol=5).dump(obj)     # the by-value pickler itself, to subclass
    token(var); stand_in(token(var))          # here; over there: the worker's variable
"""

from __future__ import annotations

import contextvars
import functools
import io
import os
import pickle
from typing import Any

from ._private import code_reduce


@functools.cache
def by_value() -> type:
    """cloudpickle's pickler, keeping each function's file name (built once, when first
    needed: cloudpickle is imported only then)."""
    import types
    from collections import ChainMap

    import cloudpickle

    def code(co: types.CodeType) -> tuple:
        make, args = code_reduce(co)
        return make, tuple(co.co_filename if type(a) is str and a == "<dynamic-code>" else a
                           for a in args)

    class ByValue(cloudpickle.CloudPickler):
        dispatch_table = ChainMap({types.CodeType: code, contextvars.ContextVar: _var},
                                  cloudpickle.CloudPickler.dispatch_table)

    return ByValue


_STAND_INS: dict[str, contextvars.ContextVar] = {}  # over there: by the token of one here


def token(var: contextvars.ContextVar) -> str:
    """Which variable of which process ``var`` is (what names its stand-in over there)."""
    return f"{os.getpid()}:{id(var)}:{var.name}"


def stand_in(key: str, name: str = "", *default: Any) -> contextvars.ContextVar:
    """Over there: the worker's one variable standing in for the one ``key`` names."""
    var = _STAND_INS.get(key)
    if var is None:
        var = _STAND_INS[key] = contextvars.ContextVar(
            name or key, **({"default": default[0]} if default else {}))
    return var


def _default(var: contextvars.ContextVar) -> tuple:
    try:  # (get() with no value set answers the default it was made with, if any)
        return (var.get(),)
    except LookupError:
        return ()


def _var(var: contextvars.ContextVar) -> tuple:
    # its default as a fresh context reads it (a ContextVar does not say it otherwise)
    return stand_in, (token(var), var.name, *contextvars.Context().run(_default, var))


def dumps(obj: Any) -> bytes:
    """``obj`` pickled: plainly when nothing in it is the script's, else by value."""
    try:  # the plain pickler is several times faster: used where nothing is __main__'s
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in blob:
            return blob
    except Exception:  # a lambda, a local class: by value
        pass
    buf = io.BytesIO()
    by_value()(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
