"""An exception raised over there, raised here as its own type: the same class (pickled
by value when the script defines it), the worker's traceback as its ``__cause__``, the
module and worker named. One that cannot be rebuilt here is raised as a class deriving
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
    message and formatted traceback."""

    blob: bytes | None
    cls: bytes | None
    name: str
    message: str
    trace: str


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
    return Raised(blob, cls, type(e).__name__, str(e), trace)


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
