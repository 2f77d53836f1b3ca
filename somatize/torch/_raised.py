"""An exception raised over there, raised here as its own type: the same class (pickled
by value when the script defines it), the worker's traceback as its ``__cause__``, the
module and worker named. An exception of a class of the user's travels as its class, its
``args`` and its attributes, and is rebuilt without calling its ``__init__`` again (which
may want other arguments than ``args``, or set its attributes from them): ``e.idx`` is
what it was over there. One that cannot be rebuilt here is raised as a class deriving
from both ``WorkerError`` and its own; a lost worker stays ``WorkerError``.

    try: out = fn(...)                   # over there
    except Exception as e: return caught(e)
    if isinstance(got, Raised): raise rebuilt(got, "module 'enc' on worker 'w' (pid 7)")
"""

from __future__ import annotations

import linecache
import pickle
import re
import sys
import traceback
from dataclasses import dataclass

from .._errors import WorkerError


@dataclass(frozen=True)
class Raised:
    """An exception as it travels back: itself pickled (when it pickles), its class,
    message and formatted traceback; for a class of the user's, its class, args and
    attributes (``parts``)."""

    blob: bytes | None
    cls: bytes | None
    name: str
    message: str
    trace: str
    parts: bytes | None = None


class WorkerTraceback(Exception):
    """The traceback of an exception raised on a worker (the ``__cause__`` of the one
    raised here): the user's files and lines over there."""

    def __str__(self) -> str:
        return self.args[0]


def caught(e: BaseException) -> Raised:
    """Over there: ``e`` ready to travel."""
    import cloudpickle

    trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    blob = cls = None
    try:
        blob = cloudpickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    try:
        cls = cloudpickle.dumps(type(e), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    parts = None
    if _plain_class(type(e)):
        try:
            parts = cloudpickle.dumps((type(e), e.args, _attributes(e)),
                                      protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            pass
    return Raised(blob, cls, type(e).__name__, str(e), trace, parts)


def _plain_class(cls: type) -> bool:
    # a class of the user's whose pickling is BaseException's: (cls, args) + __dict__,
    # which calls its __init__ with args again
    return cls.__module__ != "builtins" and cls.__reduce_ex__ is BaseException.__reduce_ex__ \
        and cls.__reduce__ is BaseException.__reduce__


def _attributes(e: BaseException) -> tuple[dict, dict]:
    # its __dict__, and what its classes' __slots__ hold
    slots = {k: getattr(e, k) for c in type(e).__mro__ if c.__module__ != "builtins"
             for k in c.__dict__.get("__slots__", ()) if isinstance(k, str) and hasattr(e, k)}
    return dict(getattr(e, "__dict__", {})), slots


def _from_parts(r: Raised) -> BaseException | None:
    # its class, args and attributes, as they were over there: no __init__ runs again
    try:
        cls, args, (attributes, slots) = pickle.loads(r.parts)
        e = cls.__new__(cls, *args)
        e.args = args
        e.__dict__.update(attributes)
        for k, v in slots.items():
            setattr(e, k, v)
    except Exception:
        return None
    return e if isinstance(e, BaseException) else None


def rebuilt(r: Raised, where: str) -> BaseException:
    """Here: the exception ``r`` carries, raised in ``where`` (the module and worker)."""
    cause = WorkerTraceback(f"traceback on {where}:\n{_named(r.trace)}")
    e = _instance(r, where)
    if e is None:
        cls = _class(r)
        e = _both(cls, r, where) if cls is not None else None
    if e is None:
        e = WorkerError(f"{where} raised {r.name}: {r.message}")
    e.__cause__ = cause
    return e


def _named(trace: str) -> str:
    # code sent by value (the script's) runs over there under cloudpickle's
    # "<dynamic-code>": it is the script's, so its file and line are said as here
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main:
        return trace

    def line(m: re.Match) -> str:
        source = linecache.getline(main, int(m[1])).strip()
        return f'File "{main}", line {m[1]}, in {m[2]}' + (f"\n    {source}" if source else "")

    return re.sub(r'File "<dynamic-code>", line (\d+), in (\S+)', line, trace)


def _instance(r: Raised, where: str) -> BaseException | None:
    e = _from_parts(r) if r.parts is not None else None
    if e is None:
        if r.blob is None:
            return None
        try:
            e = pickle.loads(r.blob)
        except Exception:
            return None
    if not isinstance(e, BaseException):
        return None
    if len(e.args) == 1 and isinstance(e.args[0], str) and str(e) == e.args[0] \
            and not isinstance(e, KeyError):
        e.args = (f"{e.args[0]} (raised in {where})",)  # the worker named in the message
    else:
        e.add_note(f"raised in {where}")
    return e


def _class(r: Raised) -> type | None:
    if r.cls is None:
        return None
    try:
        cls = pickle.loads(r.cls)
    except Exception:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else None


def _both(cls: type, r: Raised, where: str) -> BaseException | None:
    # its own type could not be rebuilt from its arguments: one deriving from both
    if issubclass(cls, WorkerError):
        return None
    message = f"{where} raised {r.name}: {r.message}"
    try:
        both = type(cls.__name__, (WorkerError, cls), {"__module__": cls.__module__})
        e = BaseException.__new__(both, message)  # its own __init__ may want other arguments
        BaseException.__init__(e, message)
        return e
    except TypeError:  # incompatible layouts (an OSError subclass): WorkerError alone
        return None
