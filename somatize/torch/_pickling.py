"""How somatize pickles what it sends to a worker (a function to call, a call's
structure, a node that does not pickle plainly): plainly where nothing in it is the
script's, by value (cloudpickle) where something is: a class or function defined in
``__main__``, a lambda, a local function. Code sent by value keeps its file name, so a
traceback over there names the user's file and line (cloudpickle writes
``<dynamic-code>``).

    blob = dumps(obj)                         # pickle.loads(blob) over there
    by_value()(buf, protocol=5).dump(obj)     # the by-value pickler itself, to subclass
"""

from __future__ import annotations

import functools
import io
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
        dispatch_table = ChainMap({types.CodeType: code}, cloudpickle.CloudPickler.dispatch_table)

    return ByValue


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
