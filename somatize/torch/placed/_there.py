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

from ..._draws import refuse_drawn, seen
from ..._errors import Refused, WorkerError
from ..._trace import span
from .._module import ModuleNode
from .._pickling import dumps, stand_in
from .._private import hooks_of, version, versions
from .._raised import Raised, caught
from .._seeds import seeded
from .._state import on_cpu
from ._fans import fans, heard
from ._looks import looks, mutable
from ._messages import Answer, Call, Pickled, Same, bare, pack, unpack
from ._ordinary import _OWN
from ._reach import described, reach
from ._registries import register, registered
from ._tree import tree_flatten, tree_unflatten


class Placed(ModuleNode):
    """A placed module where it runs: the calls kept for their backward, the optimizers
    that mirror the ones here (by index of the optimizer here), and the one the user
    chose for it (``trains=``), if any."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.kept: dict[int, tuple] = {}  # (leaves, outputs, fans)
        self.mirrors: dict[int, torch.optim.Optimizer] = {}
        self.chosen: torch.optim.Optimizer | None = None
        self.registered = registered(module)  # what building it registered here


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


def _state(live, name: str, ops: list) -> dict | Raised:
    """The module's weights and buffers, and its mirrors' states by parameter name, on
    the CPU, once ``ops`` are applied."""
    placed = live.catalog[name]
    try:
        _apply(placed, ops)
    except Exception as e:  # a queued backward's error, rebuilt there as its own type
        return caught(e)
    names = {id(p): n for n, p in placed.module.named_parameters()}
    optim = {i: {names[id(p)]: on_cpu(st) for p, st in opt.state.items()}
             for i, opt in placed.mirrors.items()}
    return {"weights": on_cpu(placed.module.state_dict()), "optimizers": optim}


def _applied(live, name: str, ops: list) -> Raised | None:
    """``ops`` applied, nothing read (what is queued, sent on its own)."""
    try:
        _apply(live.catalog[name], ops)
    except Exception as e:  # a backward's error, rebuilt there as its own type
        return caught(e)
    return None


def _weights(live, name: str, ops: list) -> dict | Raised:
    """The module's weights and buffers now (on the CPU), once ``ops`` are applied."""
    placed = live.catalog[name]
    try:
        _apply(placed, ops)
    except Exception as e:  # a queued backward's error, rebuilt there as its own type
        return caught(e)
    return on_cpu(placed.module.state_dict())


def _call(live, name: str, call: Call) -> Answer | Raised:
    try:
        placed = live.catalog[name]
        dev = _settled_on(placed, call.device)
        if placed.registered:  # before its first call: what building it registered here
            register(placed.registered)
            placed.registered = ()
        tensors = [t.to(dev) for t in call.tensors]
        _apply(placed, call.ops)
        structure = call.structure
        if type(structure) is Pickled:
            try:
                spec, plain, *carried = pickle.loads(structure.blob)
            except Exception as e:
                raise WorkerError(
                    f"the worker could not read the arguments of a call to {name!r} "
                    f"({type(e).__name__}: {e}): a class they use must be importable over "
                    "there (installed, or on its PYTHONPATH) or defined in your script"
                ) from None
        else:
            spec, plain, carried = None, structure, ()
        with contextlib.ExitStack() as under:
            if type(call.rng) is int:  # a seed of its own: no RNG state crossed
                under.enter_context(seeded(call.rng, dev))
            else:
                torch.set_rng_state(call.rng)
            for device_type, cast, cache in call.autocast:  # the caller's, as it was
                under.enter_context(torch.autocast(device_type, dtype=cast,
                                                   cache_enabled=cache))
            if call.dtype != torch.get_default_dtype():  # bf16-true / 16-true set it
                under.callback(torch.set_default_dtype, torch.get_default_dtype())
                torch.set_default_dtype(call.dtype)
            return _run_call(placed, name, call, tensors, spec, plain, carried)
    except Exception as e:  # raised there as its own type, with this traceback as cause
        return caught(e)


def _run_call(placed: Any, name: str, call: Call, tensors: list, spec: Any,
              plain: Any, carried: Any = ()) -> Answer:
    needs = call.needs
    leaves = [t.detach().requires_grad_() if need else t
              for t, need in zip(tensors, needs, strict=True)]
    if spec is None:  # distinct tensors only (Spread)
        n = plain.positional
        flat, args = leaves, tuple(leaves[:n])
        kwargs = dict(zip(plain.names, leaves[n:], strict=True))
        tree = (args, kwargs)
    else:
        flat = unpack(leaves, plain)
        tree = args, kwargs = tree_unflatten(flat, spec)
    if carried:  # the context variables the children's hooks read, as they are here
        held_spec, held = carried
        carried = tree_unflatten(held, held_spec)
        tree, flat = (args, kwargs, carried), [*flat, *held]
    else:
        carried = {}
    was = versions(leaves)
    modules = placed.__dict__.get("modules") or placed.__dict__.setdefault(
        "modules", list(placed.module.modules()))
    before = [(list(m.__dict__), list(m.__dict__.values())) for m in modules]
    watch = placed.__dict__.get("watch")
    if watch is None:
        watch = placed.__dict__["watch"] = _watched(placed.module)
    looked = [looks(o) for *_, o in watch]
    deep = placed.__dict__.get("deep")
    if deep is None:  # what the modules hold that can change in place (a list on self)
        deep = placed.__dict__["deep"] = [(i, k) for i, m in enumerate(modules)
                                          for k, v in m.__dict__.items()
                                          if k not in _OWN and mutable(v)]
    held = [looks(modules[i].__dict__.get(k)) for i, k in deep]
    # the module's own hooks ran here, around this call: its forward alone runs here
    forward = placed.module.forward
    drawn = seen(placed.__dict__)
    with span(f"forward {name}", "node"), _set(carried):
        if call.inference:
            with torch.inference_mode():
                out = forward(*args, **kwargs)
        else:
            with torch.set_grad_enabled(call.grad):
                out = forward(*args, **kwargs)
    refuse_drawn(f"the forward of {name!r}", repr(name), drawn)
    for (where, hook, what, o), then in zip(watch, looked, strict=True):
        if looks(o) != then:
            raise Refused(
                f"a hook on {name}.{where}, {hook}, changed {what!r} (outside the module) "
                f"on the worker that runs {name!r}: that change stays there, and here "
                f"{what!r} would not see it. Set what the hook records as an attribute of "
                f"its module (module.features = output: it comes back after each call), "
                f"register the hook on {name!r} itself (it runs here), or leave {name!r} "
                "unplaced")
    side = _left(modules, before)
    for (i, k), then in zip(deep, held, strict=True):  # changed in place: comes back too
        v = modules[i].__dict__.get(k)
        if looks(v) != then and _travels(v) and not any(s[0] == i and s[1] == k for s in side):
            side.append((i, k, v))
    # a structure of tensors alone changes only through a tensor written in place
    changed = None if spec is None and versions(leaves) == was else _changed(
        tree, flat, leaves, was)
    structure = None if side or changed is not None else bare(out)
    if structure is None:  # pickled: the output, what it left, the arguments it changed
        out_flat, out_spec = tree_flatten((out, side, changed))
        outs, out_plain = pack(out_flat)
    else:
        outs = [out] if structure.lone else list(out)
    uses = ()
    if call.grad and any(t.requires_grad for t in outs):
        kept = [t if need else None for t, need in zip(leaves, needs, strict=True)]
        fan = fans(outs, [t for t in kept if t is not None]) if any(needs) else {}
        placed.kept[call.number] = (kept, outs, fan)
        if fan:  # an argument used more than once: its uses' gradients answered apart
            uses = tuple(len(fan.get(i, ())) or 1 for i in range(sum(needs)))
    if structure is None:
        structure = Pickled(dumps((out_spec, out_plain)))
    # tensors cross on the CPU (no TensorPipe device maps yet): moved at the boundary;
    # a detached output stays so here
    return Answer([t.detach().cpu() for t in outs], structure,
                  [t.requires_grad for t in outs],
                  None if type(call.rng) is int else torch.get_rng_state(), os.getpid(),
                  call.number in placed.kept, uses)

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


def _watched(module: torch.nn.Module) -> list:
    # what the children's hooks can write outside the module: (path, hook, name, object)
    return [(path, described(fn), what, o) for path, m in module.named_modules() if path
            for d in hooks_of(m).values() if isinstance(d, dict)
            for fn in d.values() if callable(fn) for what, o in reach(fn)]


def _travels(v: Any) -> bool:
    # what a forward leaves on its modules that comes back: tensors, plain values, their
    # containers (a module, an optimizer or a handle stays over there)
    if isinstance(v, (torch.Tensor, int, float, bool, str, type(None), torch.dtype)):
        return True
    if isinstance(v, (tuple, list, dict)):
        return all(_travels(x) for x in (v.values() if isinstance(v, dict) else v))
    import dataclasses

    return dataclasses.is_dataclass(v) and not isinstance(v, type)


@contextlib.contextmanager
def _set(carried: dict):
    # the context variables the children's hooks read, set as they are here for the call
    tokens = [(var, var.set(v)) for var, v in ((stand_in(k), v) for k, v in carried.items())]
    try:
        yield
    finally:
        for var, t in reversed(tokens):
            var.reset(t)


def _changed(tree: tuple, flat: list, leaves: list, versions: list) -> Any:
    """The arguments (and carried context values), when the forward changed them in place
    (appended to a list, wrote into a tensor); else None. Tensors it left alone stand as
    ``Same`` (the caller's)."""
    after, spec = tree_flatten(tree)
    touched = {id(t) for t, v in zip(leaves, versions, strict=True) if version(t) != v}
    same = len(after) == len(flat) and all(a is b for a, b in zip(after, flat, strict=True))
    if same and not touched:
        return None
    index = {id(t): i for i, t in enumerate(leaves)}
    return tree_unflatten([Same(index[id(t)]) if isinstance(t, torch.Tensor) and id(t) in index
                           and id(t) not in touched else t for t in after], spec)


def _backward(live, name: str, call: int, grads: list, ops: list, accumulate: bool = True,
              then: int | None = None, asks: list | None = None, joined: tuple = ()) -> Any:
    """dL/d(the call's arguments), given dL/d(its outputs): into the weights too when
    ``accumulate`` (``.backward()``, not ``autograd.grad`` on the inputs). The call's graph
    stays (a second backward, ``retain_graph``) until a ``Free`` says the one here is gone.
    With ``then`` (``create_graph``), the answer is differentiable: kept as call ``then``,
    whose arguments are the gradients that ``asks`` and the call's own; answered with
    which of them carry a gradient. ``joined``: the (call, dL/d(outputs)) of create_graph
    answers whose backward goes in this pass too (one pass, as in one piece)."""
    try:
        placed = live.catalog[name]
        _apply(placed, ops)  # a zero_grad between the forward and this backward
        return _backward_through(placed, name, call, grads, accumulate, then, asks, joined)
    except Exception as e:
        return caught(e)


class Backward:
    """A backward whose gradients nobody here waits for (no argument of the call needs
    one): it goes with the next message, done over there before what follows it (as the
    optimizer's step, queued after it, is), so a step sends one message, not two."""

    def __init__(self, name: str, call: int, grads: list, accumulate: bool,
                 joined: tuple = ()):
        self.name, self.call, self.grads, self.accumulate = name, call, grads, accumulate
        self.joined = joined

    def apply(self, placed: Placed) -> None:
        # raised, it is the message's: the next call answers Raised, rebuilt here
        _backward_through(placed, self.name, self.call, self.grads, self.accumulate,
                          joined=self.joined)


def _kept(placed: Placed, name: str, call: int) -> tuple:
    got = placed.kept.get(call)
    if got is None:
        raise RuntimeError(
            f"a backward reached {name!r} for a call whose graph was freed: call "
            ".backward(retain_graph=True) the first time to go through it again")
    return got


def _backward_through(placed: Placed, name: str, call: int, grads: list, accumulate: bool,
                      then: int | None = None, asks: list | None = None,
                      joined: tuple = ()) -> Any:
    leaves, outs, *fan = _kept(placed, name, call)
    create = then is not None
    fan = fan[0] if fan and not create else {}  # (under create_graph: summed here)
    device = outs[0].device if outs else None
    given = [None if g is None else g.to(device) for g in grads]
    if create:
        given = [g.detach().requires_grad_() if ask and g is not None else g
                 for g, ask in zip(given, asks, strict=True)]
    pairs = [(o, g) for o, g in zip(outs, given, strict=True)
             if g is not None and o.requires_grad]
    wanted = [leaf for leaf in leaves if leaf is not None]
    also: list = []  # the joined answers' own leaves (the gradients they were given)
    for number, gs in reversed(joined):  # (each joined answer's roots ahead of its parent's)
        j_leaves, j_outs = _kept(placed, name, number)[:2]
        pairs[:0] = [(o, g.to(device)) for o, g in zip(j_outs, gs, strict=True)
                     if g is not None and o.requires_grad]
        also += [leaf for leaf in j_leaves if leaf is not None]
    back: list = [None] * len(wanted)
    if pairs:
        with span(f"backward {name}", "node"), torch.set_grad_enabled(create), \
                heard(fan) as told:
            o, g = [o for o, _ in pairs], [g for _, g in pairs]
            if accumulate:  # the weights' .grad too; the arguments' read and let go
                for leaf in (*also, *wanted):
                    leaf.grad = None
                torch.autograd.backward(o, g, retain_graph=True, create_graph=create)
                back = [leaf.grad for leaf in wanted]
                for leaf in (*also, *wanted):
                    leaf.grad = None
            elif wanted:
                back = list(torch.autograd.grad(o, wanted, g, retain_graph=True,
                                                create_graph=create, allow_unused=True))
        for i, uses in told.items():  # each use's gradient, in the order they were added
            back[i] = [None if u is None else u.cpu() for u in uses]
    it = iter(back)
    back = [None if leaf is None else next(it) for leaf in leaves]
    if not create:
        return [b.cpu() if isinstance(b, torch.Tensor) else b for b in back]
    kept_outs = [b for b in back if b is not None]
    if any(t.requires_grad for t in kept_outs):
        placed.kept[then] = ([g if ask else None for g, ask in zip(given, asks, strict=True)]
                             + wanted, kept_outs)
    return ([None if b is None else b.detach().cpu() for b in back],
            [b is not None and b.requires_grad for b in back])
