"""A placed module's call, where it runs: the arguments rebuilt in their own types, the
forward, and the answer: the output, what the forward left on the module's attributes,
and the arguments it changed in place, all in one structure whose tensors are the
outputs of the call's node here (so each sends its gradient back). An exception raised
here travels as ``Raised``, rebuilt there as its own type.

    answer = _call(live, "encoder", 0, tensors, blob, needs, ...)   # over there

What does not change from call to call travels light: arguments that are distinct
tensors only travel without a pickled structure (``blob`` is ``(len(args), kwargs'
names)``), and so does an output that is one tensor or a tuple of distinct tensors,
when the forward left nothing on its modules and changed no argument.
"""

from __future__ import annotations

import contextlib
import operator
import os
import pickle
from typing import Any

import torch

from .._errors import WorkerError
from .._trace import span
from ._private import version, versions
from ._raised import caught
from ._tree import tree_flatten, tree_unflatten


class TensorHere:
    """Marks, among a structure's plain leaves, where a tensor stood (it travels apart)."""


class Same:
    """An argument tensor the forward left as it was: the caller's own tensor ``i`` (a
    leaf to the walker, not a dataclass it would walk into)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def pack(flat: list) -> tuple[list, list]:
    """The tensors of ``flat``, and its other leaves with ``TensorHere`` in their place."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    return tensors, [TensorHere if isinstance(t, torch.Tensor) else t for t in flat]


def unpack(tensors: Any, plain: list) -> list:
    it = iter(tensors)
    return [next(it) if p is TensorHere else p for p in plain]


def plain_args(args: tuple, kwargs: dict) -> tuple | None:
    """``(len(args), kwargs' names)`` when every argument is a tensor and no tensor
    stands twice: the call needs no pickled structure. Else None."""
    n = len(args)
    if not all(isinstance(a, torch.Tensor) for a in args) or not all(
            isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    ids = {id(a) for a in args}
    ids.update(id(v) for v in kwargs.values())
    return (n, tuple(kwargs)) if len(ids) == n + len(kwargs) else None


def plain_out(out: Any) -> int | None:
    """How an answer's structure travels when the output is one tensor (``None``) or a
    tuple of ``n`` distinct tensors (``n``); else ``-1`` (pickled)."""
    if isinstance(out, torch.Tensor):
        return None
    if type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out) \
            and len({id(t) for t in out}) == len(out):
        return len(out)
    return -1


def dumps(obj: Any) -> bytes:
    """Classes and functions defined in the script (``__main__``) by value."""
    try:  # the plain pickler is several times faster: used where nothing is __main__'s
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in blob:
            return blob
    except Exception:
        pass
    import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _call(live, name: str, call: int, tensors: list, blob: bytes | tuple, needs: list[bool],
          grad: bool, inference: bool, rng: torch.Tensor, ops: list, autocast: list,
          dtype: torch.dtype, device: str = "cpu"):
    from ._placed import _apply, _moved, _settled_on  # (_placed imports this module)

    try:
        placed = live.catalog[name]
        dev = _settled_on(placed, device)
        tensors = [_moved(t, dev) for t in tensors]
        _apply(placed, ops)
        try:
            spec, plain = (None, blob) if isinstance(blob, tuple) else pickle.loads(blob)
        except Exception as e:
            raise WorkerError(
                f"the worker could not read the arguments of a call to {name!r} "
                f"({type(e).__name__}: {e}): a class they use must be importable over there "
                "(installed, or on its PYTHONPATH) or defined in your script") from None
        torch.set_rng_state(rng)
        with contextlib.ExitStack() as under:
            for device_type, cast, cache in autocast:  # the caller's autocast, as it was
                under.enter_context(torch.autocast(device_type, dtype=cast,
                                                   cache_enabled=cache))
            if dtype != torch.get_default_dtype():  # bf16-true / 16-true set it for forward
                under.callback(torch.set_default_dtype, torch.get_default_dtype())
                torch.set_default_dtype(dtype)
            return _run_call(placed, name, call, tensors, spec, plain, needs, grad, inference)
    except Exception as e:  # raised there as its own type, with this traceback as cause
        return caught(e)


def _run_call(placed: Any, name: str, call: int, tensors: list, spec: Any, plain: Any,
              needs: list[bool], grad: bool, inference: bool):
    leaves = [t.detach().requires_grad_() if need else t
              for t, need in zip(tensors, needs, strict=True)]
    if spec is None:  # distinct tensors only (plain_args): (len(args), kwargs' names)
        n, names = plain
        flat, args, kwargs = leaves, tuple(leaves[:n]), dict(zip(names, leaves[n:], strict=True))
    else:
        flat = unpack(leaves, plain)
        args, kwargs = tree_unflatten(flat, spec)
    was = versions(leaves)
    modules = placed.__dict__.get("modules") or placed.__dict__.setdefault(
        "modules", list(placed.module.modules()))
    before = [(list(m.__dict__), list(m.__dict__.values())) for m in modules]
    with span(f"forward {name}", "node"):
        if inference:
            with torch.inference_mode():
                out = placed.module(*args, **kwargs)
        else:
            with torch.set_grad_enabled(grad):
                out = placed.module(*args, **kwargs)
    side = _left(modules, before)
    # a structure of tensors alone changes only through a tensor written in place
    changed = None if spec is None and versions(leaves) == was else _changed(
        args, kwargs, flat, leaves, was)
    shape = -1 if side or changed is not None else plain_out(out)
    if shape == -1:
        out_flat, out_spec = tree_flatten((out, side, changed))
        outs, out_plain = pack(out_flat)
    else:
        outs = [out] if shape is None else list(out)
    if grad and any(t.requires_grad for t in outs):
        placed.kept[call] = ([t if need else None for t, need in zip(leaves, needs, strict=True)],
                             outs)
    # tensors cross on the CPU (no TensorPipe device maps yet): moved at the boundary
    answer = [t.detach().cpu() for t in outs]
    # kept: whether this call waits for a backward (a frozen module's does not)
    # which outputs carry a gradient over there (a detached one stays so here)
    alive = [t.requires_grad for t in outs]
    if shape == -1:
        shape = dumps((out_spec, out_plain))
    return answer, shape, alive, torch.get_rng_state(), os.getpid(), call in placed.kept


_MISSING = object()


def _left(modules: list, before: list) -> list:
    # what the forward set or replaced on its modules' __dict__ and that travels, as
    # (module index, name, value); a dict whose names and values are all as they were
    # is passed over at C speed
    side = []
    for i, (m, (names, values)) in enumerate(zip(modules, before, strict=True)):
        d = m.__dict__
        if len(d) == len(names) and all(map(operator.is_, d.values(), values)) \
                and list(d) == names:
            continue
        was = dict(zip(names, values, strict=True))
        side += [(i, k, v) for k, v in d.items()
                 if was.get(k, _MISSING) is not v and _travels(v)]
    return side


def _travels(v: Any) -> bool:
    # what a forward leaves on its modules that comes back: tensors, plain values, their
    # containers (a module, an optimizer or a handle stays over there)
    if isinstance(v, (torch.Tensor, int, float, bool, str, type(None), torch.dtype)):
        return True
    if isinstance(v, (tuple, list, dict)):
        return all(_travels(x) for x in (v.values() if isinstance(v, dict) else v))
    import dataclasses

    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def _changed(args: tuple, kwargs: dict, flat: list, leaves: list, versions: list) -> Any:
    """The arguments, when the forward changed them in place (appended to a list, wrote
    into a tensor); else None. Tensors it left alone stand as ``Same`` (the caller's)."""
    after, spec = tree_flatten((args, kwargs))
    touched = {id(t) for t, v in zip(leaves, versions, strict=True) if version(t) != v}
    same = len(after) == len(flat) and all(a is b for a, b in zip(after, flat, strict=True))
    if same and not touched:
        return None
    index = {id(t): i for i, t in enumerate(leaves)}
    return tree_unflatten([Same(index[id(t)]) if isinstance(t, torch.Tensor) and id(t) in index
                           and id(t) not in touched else t for t in after], spec)


def _backward(live, name: str, call: int, grads: list, ops: list) -> list:
    from ._placed import _apply

    try:
        placed = live.catalog[name]
        _apply(placed, ops)  # a zero_grad between the forward and this backward
        leaves, outs = placed.kept.pop(call)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if g is not None and o.requires_grad]
        if pairs:
            with span(f"backward {name}", "node"):
                torch.autograd.backward([o for o, _ in pairs],
                                        [g.to(o.device) for o, g in pairs])
        return [None if leaf is None or leaf.grad is None else leaf.grad.cpu()
                for leaf in leaves]
    except Exception as e:
        return caught(e)


def _weights(live, name: str, ops: list) -> dict:
    """The module's weights and buffers now (on the CPU), once ``ops`` are applied."""
    from ._placed import _apply

    placed = live.catalog[name]
    _apply(placed, ops)
    return {k: v.detach().to("cpu", copy=True) for k, v in placed.module.state_dict().items()}
