"""A placed module's call, where it runs: a ``Call``'s arguments rebuilt in their own
types, the forward, and its ``Answer``: the output, what the forward left on the
module's attributes, and the arguments it changed in place, all in one structure whose
tensors are the outputs of the call's node here (so each sends its gradient back). An
exception raised here travels as ``Raised``, rebuilt there as its own type. Also what
else the worker runs for a placed module: its backward, its ops, its state read.

    answer = _call(live, "encoder", call)          # over there: an Answer, or a Raised
    grads = _backward(live, "encoder", call.number, grads_of_outputs, ops)

What does not change from call to call travels light: arguments that are distinct
tensors only travel without a pickled structure (``Spread``), and so does an output
that is one tensor or a tuple of distinct tensors (``Bare``), when the forward left
nothing on its modules and changed no argument.
"""

from __future__ import annotations

import contextlib
import operator
import os
import pickle
from typing import Any

import torch

from ..._errors import WorkerError
from ..._trace import span
from .._module import ModuleNode
from .._pickling import dumps
from .._private import version, versions
from .._raised import Raised, caught
from .._state import on_cpu
from ._messages import Answer, Call, Pickled, Same, bare, pack, unpack
from ._tree import tree_flatten, tree_unflatten


class Placed(ModuleNode):
    """A placed module where it runs: the calls kept for their backward, the optimizers
    that mirror the ones here (by index of the optimizer here), and the one the user
    chose for it (``trains=``), if any."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.kept: dict[int, tuple[list, list]] = {}
        self.mirrors: dict[int, torch.optim.Optimizer] = {}
        self.chosen: torch.optim.Optimizer | None = None


def _apply(placed: Placed, ops: list) -> None:
    for op in ops:  # typed: _module_ops, _ordinary.SetAttributes, _mirror_ops
        op.apply(placed)


def _settled_on(placed: Placed, device: str) -> torch.device:
    # the module computes on the worker's device; moved once, before any optimizer holds it
    dev = torch.device(device)
    if getattr(placed, "device", None) != dev:
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise WorkerError(f"this worker was given device {device!r} but has no GPU: "
                               "start it with --device cpu (Worker(device='cpu'))")
        placed.module.to(dev)
        placed.device = dev
    return dev


def _state(live, name: str, ops: list) -> dict:
    """The module's weights and buffers, and its mirrors' states by parameter name, on
    the CPU, once ``ops`` are applied."""
    placed = live.catalog[name]
    _apply(placed, ops)
    names = {id(p): n for n, p in placed.module.named_parameters()}
    optim = {i: {names[id(p)]: on_cpu(st) for p, st in opt.state.items()}
             for i, opt in placed.mirrors.items()}
    return {"weights": on_cpu(placed.module.state_dict()), "optimizers": optim}


def _weights(live, name: str, ops: list) -> dict:
    """The module's weights and buffers now (on the CPU), once ``ops`` are applied."""
    placed = live.catalog[name]
    _apply(placed, ops)
    return on_cpu(placed.module.state_dict())


def _call(live, name: str, call: Call) -> Answer | Raised:
    try:
        placed = live.catalog[name]
        dev = _settled_on(placed, call.device)
        tensors = [t.to(dev) for t in call.tensors]
        _apply(placed, call.ops)
        structure = call.structure
        if type(structure) is Pickled:
            try:
                spec, plain = pickle.loads(structure.blob)
            except Exception as e:
                raise WorkerError(
                    f"the worker could not read the arguments of a call to {name!r} "
                    f"({type(e).__name__}: {e}): a class they use must be importable over "
                    "there (installed, or on its PYTHONPATH) or defined in your script"
                ) from None
        else:
            spec, plain = None, structure
        torch.set_rng_state(call.rng)
        with contextlib.ExitStack() as under:
            for device_type, cast, cache in call.autocast:  # the caller's, as it was
                under.enter_context(torch.autocast(device_type, dtype=cast,
                                                   cache_enabled=cache))
            if call.dtype != torch.get_default_dtype():  # bf16-true / 16-true set it
                under.callback(torch.set_default_dtype, torch.get_default_dtype())
                torch.set_default_dtype(call.dtype)
            return _run_call(placed, name, call, tensors, spec, plain)
    except Exception as e:  # raised there as its own type, with this traceback as cause
        return caught(e)


def _run_call(placed: Any, name: str, call: Call, tensors: list, spec: Any,
              plain: Any) -> Answer:
    needs = call.needs
    leaves = [t.detach().requires_grad_() if need else t
              for t, need in zip(tensors, needs, strict=True)]
    if spec is None:  # distinct tensors only (Spread)
        n = plain.positional
        flat, args = leaves, tuple(leaves[:n])
        kwargs = dict(zip(plain.names, leaves[n:], strict=True))
    else:
        flat = unpack(leaves, plain)
        args, kwargs = tree_unflatten(flat, spec)
    was = versions(leaves)
    modules = placed.__dict__.get("modules") or placed.__dict__.setdefault(
        "modules", list(placed.module.modules()))
    before = [(list(m.__dict__), list(m.__dict__.values())) for m in modules]
    with span(f"forward {name}", "node"):
        if call.inference:
            with torch.inference_mode():
                out = placed.module(*args, **kwargs)
        else:
            with torch.set_grad_enabled(call.grad):
                out = placed.module(*args, **kwargs)
    side = _left(modules, before)
    # a structure of tensors alone changes only through a tensor written in place
    changed = None if spec is None and versions(leaves) == was else _changed(
        args, kwargs, flat, leaves, was)
    structure = None if side or changed is not None else bare(out)
    if structure is None:  # pickled: the output, what it left, the arguments it changed
        out_flat, out_spec = tree_flatten((out, side, changed))
        outs, out_plain = pack(out_flat)
    else:
        outs = [out] if structure.lone else list(out)
    if call.grad and any(t.requires_grad for t in outs):
        placed.kept[call.number] = (
            [t if need else None for t, need in zip(leaves, needs, strict=True)], outs)
    if structure is None:
        structure = Pickled(dumps((out_spec, out_plain)))
    # tensors cross on the CPU (no TensorPipe device maps yet): moved at the boundary;
    # a detached output stays so here
    return Answer([t.detach().cpu() for t in outs], structure,
                  [t.requires_grad for t in outs], torch.get_rng_state(), os.getpid(),
                  call.number in placed.kept)


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
