"""The process-wide settings that change a kernel's numbers (or which kernel runs), read
here and set over there, so a module placed on a worker computes as it would here.

    flags = math_flags()        # here, before a call: (name, value) pairs
    set_math(flags)             # over there: each one that differs is set

Each setting is (name, read, write). A read that raises is left out: torch refuses to
read a legacy TF32 flag once the new ``fp32_precision`` API has set it, and the reverse.
Legacy flags come before the new ones, so the side that set one API is followed through
that API.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import types
from collections.abc import Callable

import torch

from ._private import fp32_precision_getter, nnpack_flag

log = logging.getLogger(__name__)


def _attr(path: str) -> tuple[str, Callable, Callable]:
    owner, name = path.rsplit(".", 1)
    where = operator.attrgetter(owner)
    return (path, fast_read(path), lambda v: setattr(where(torch), name, v))


def fast_read(path: str) -> Callable[[], object]:
    """A read of ``torch.<path>`` in as few calls as torch allows (read at every call):
    where its attribute is a ``ContextProp`` or an ``_FP32Precision``'s, the C getter it
    calls; else the attribute, on the object that holds it (found once: torch's own
    modules, never rebound), or found each time where that object is not there."""
    *owner, attr = path.split(".")
    try:
        o = functools.reduce(getattr, owner, torch)
    except AttributeError:
        return functools.partial(operator.attrgetter(path), torch)
    plain = functools.partial(getattr, o, attr)
    prop = next((c.__dict__[attr] for c in type(o).__mro__ if attr in c.__dict__), None)
    getter = getattr(prop, "getter", None) if type(prop).__name__ == "ContextProp" else None
    fp32 = fp32_precision_getter()
    if getter is None and type(o).__name__ == "_FP32Precision" and fp32 is not None:
        getter = functools.partial(fp32, o.backend, o.op)
    inner = getattr(o, "m", None) if prop is None and isinstance(o, types.ModuleType) else None
    if getter is None and isinstance(inner, types.ModuleType):
        getter = _wrapped(o.__dict__, inner.__dict__, attr)
    try:  # the same answer, or the attribute itself (a read that raises now: kept as is)
        return getter if callable(getter) and getter() == plain() else plain
    except (AttributeError, RuntimeError):
        return plain


def _wrapped(own: dict, held: dict, attr: str) -> Callable[[], object]:
    """A read of ``attr`` of torch's module wrapper (``PropModule``) whose class has no
    property for it (``opt_einsum.enabled``): set on the wrapper, or its module's (what
    getattr finds, after the failed lookup that costs it 2.5 us)."""
    def read() -> object:
        v = own.get(attr, own)
        return held[attr] if v is own else v
    return read


_TINY = [1e-310]  # a subnormal double: read as zero where denormals are flushed


def _flushing() -> bool:
    """Whether this thread flushes denormals to zero (``torch.set_flush_denormal(True)``:
    torch offers no read of it, but the CPU's own float math shows it)."""
    return _TINY[0] * 1.0 == 0.0


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


_MATH = [
    ("threads", torch.get_num_threads, torch.set_num_threads),
    # Lightning's deterministic=True sets it here: cuBLAS reads it, before the flag below
    ("CUBLAS_WORKSPACE_CONFIG", lambda: os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
     lambda v: _set_env("CUBLAS_WORKSPACE_CONFIG", v)),
    ("float32_matmul_precision", torch.get_float32_matmul_precision,
     torch.set_float32_matmul_precision),
    ("deterministic_algorithms",
     lambda: (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    _attr("backends.cuda.matmul.allow_tf32"),
    _attr("backends.cudnn.allow_tf32"),
    _attr("backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
    _attr("backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
    _attr("backends.cudnn.benchmark"),
    _attr("backends.cudnn.deterministic"),
    _attr("backends.cudnn.enabled"),
    *[_attr(f"backends.{api}.fp32_precision")
      for api in ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv",
                  "mkldnn.rnn")],
    # the CPU's: oneDNN on or off picks another convolution (other last bits), einsum's
    # contraction order, the fast path of nn.MultiheadAttention and TransformerEncoderLayer,
    # the quantized engine
    _attr("backends.mkldnn.enabled"),
    _attr("backends.mkldnn.deterministic"),
    _attr("backends.opt_einsum.enabled"),
    _attr("backends.opt_einsum.strategy"),
    ("mha_fastpath", torch.backends.mha.get_fastpath_enabled,
     torch.backends.mha.set_fastpath_enabled),
    _attr("backends.quantized.engine"),
    ("flush_denormal", _flushing, torch.set_flush_denormal),
]
if nnpack_flag() is not None:  # NNPACK's convolutions, where oneDNN's are off
    _MATH.append(("nnpack", *nnpack_flag()))
_WRITERS = {name: (read, write) for name, read, write in _MATH}
_READS = {True: tuple((name, read) for name, read, _ in _MATH),
          False: tuple((name, read) for name, read, _ in _MATH if name != "threads")}


def math_flags(threads: bool = True) -> tuple:
    """This process's math settings, as ``(name, value)`` pairs (those readable);
    ``threads=False`` leaves the thread count out (a worker given its own keeps it)."""
    reads = _READS[threads]
    try:  # one pass (read at every placed call)
        return tuple([(name, read()) for name, read in reads])
    except (AttributeError, RuntimeError):
        pass
    got = []
    for name, read in reads:
        try:
            got.append((name, read()))
        except (AttributeError, RuntimeError):
            continue
    return tuple(got)


def set_math(flags: tuple) -> None:
    """Set each of ``flags`` (``math_flags()`` of another process) that differs here."""
    for name, value in flags:
        read, write = _WRITERS[name]
        try:
            if read() == value:
                continue
        except (AttributeError, RuntimeError):
            pass
        try:
            write(value)
        except Exception as e:  # noqa: BLE001 - another torch may lack or refuse a setting
            log.warning("could not set %s = %r here as the coordinator has it (%s): "
                        "numbers may differ from one piece's", name, value, e)


def set_math_live(live, flags: tuple) -> None:
    """``set_math`` as a call over there (the transport's generic call)."""
    set_math(flags)
