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
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def _attr(path: str) -> tuple[str, Callable, Callable]:
    owner, name = path.rsplit(".", 1)
    read, where = operator.attrgetter(path), operator.attrgetter(owner)  # (C: one call a read)
    return (path, functools.partial(read, torch), lambda v: setattr(where(torch), name, v))


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
if hasattr(torch._C, "_get_nnpack_enabled"):  # NNPACK's convolutions, where oneDNN's are off
    _MATH.append(("nnpack", torch._C._get_nnpack_enabled, torch._C._set_nnpack_enabled))
_WRITERS = {name: (read, write) for name, read, write in _MATH}


def math_flags(threads: bool = True) -> tuple:
    """This process's math settings, as ``(name, value)`` pairs (those readable);
    ``threads=False`` leaves the thread count out (a worker given its own keeps it)."""
    got = []
    for name, read, _ in _MATH:
        if name == "threads" and not threads:
            continue
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
