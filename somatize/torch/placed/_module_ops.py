"""What a ``Link`` (``_here.py``) sends to its placed module's worker about the module
itself, each a typed value that does its own work there (``op.apply(placed)``), queued
and sent with the next call: the modes (``train()``/``eval()``), the parameters'
``requires_grad`` and the weights written here; and ``Sent``, what the worker was last
sent of them, which queues what changed since. Plain attributes travel as
``_ordinary.SetAttributes``, the optimizers' operations as ``_mirror_ops``'; the math
settings go through the ``Session`` (``follow_math``).

    sent = Sent(module); sent.writes(ops); sent.settings(ops)      # queued here
    ops == [SetWeights({"0.weight": w}), SetModes((True, False))]
    for op in ops: op.apply(placed)                               # over there
"""

from __future__ import annotations

import operator
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import Refused
from .._pickling import dumps
from .._private import own_structure, plainly, versions
from .._state import restore
from ._ordinary import Attributes, Shape


@dataclass(frozen=True)
class Free:
    """Calls whose graph here is gone: what they keep over there for a backward goes."""
    numbers: tuple

    def apply(self, placed: Any) -> None:
        for n in self.numbers:
            placed.kept.pop(n, None)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class Kept:
    """Stands, in a ``SetStructure``, for what the module over there holds already."""


def tree(module: torch.nn.Module) -> dict:
    """Each submodule's own parameters, buffers and children, by path, with the module."""
    return {path: (m, own_structure(m)) for path, m in module.named_modules()}


def restructured(before: dict, module: torch.nn.Module) -> dict:
    """What changed in ``module``'s structure since ``before`` (``tree``): per path of a
    module that was there before, its own parameters, buffers and children in order, each
    ``Kept`` where it is the one it was, with the names of its non-persistent buffers."""
    changes = {}
    for path, (m, (params, buffers, volatile, children)) in tree(module).items():
        old = before.get(path)
        if old is None or old[0] is not m:
            continue  # new or replaced: it travels whole in its parent's children
        was_p, was_b, was_v, was_c = old[1]

        def kept(now: dict, was: dict) -> list:
            return [(k, Kept if k in was and was[k] is v else v) for k, v in now.items()]

        same = (list(params) == list(was_p) and list(buffers) == list(was_b)
                and list(children) == list(was_c) and volatile == was_v
                and all(v is was_p[k] for k, v in params.items())
                and all(v is was_b[k] for k, v in buffers.items())
                and all(v is was_c[k] for k, v in children.items()))
        if not same:
            changes[path] = (kept(params, was_p), kept(buffers, was_b), volatile,
                             kept(children, was_c))
    return changes


@dataclass(frozen=True)
class SetStructure:
    """Children, parameters and buffers registered, replaced or removed here, by module
    path, pickled (a new child travels whole, what is kept stays as it is over there)."""

    blob: bytes

    def apply(self, placed: Any) -> None:
        changes = pickle.loads(self.blob)
        modules = dict(placed.module.named_modules())
        for path, (params, buffers, volatile, children) in changes.items():
            m = modules[path]
            held = own_structure(m)
            for name in [*held[0], *held[1], *held[3]]:
                delattr(m, name)  # re-registered below, in the order they have here
            for name, p in params:
                m.register_parameter(name, held[0][name] if p is Kept else p)
            for name, b in buffers:
                m.register_buffer(name, held[1][name] if b is Kept else b,
                                  persistent=name not in volatile)
            for name, c in children:
                m.add_module(name, held[3][name] if c is Kept else c)
        device = getattr(placed, "device", None)
        if device is not None:
            placed.module.to(device)  # what came new, where the module computes
        for looked in ("modules", "watch", "deep"):  # what calls look at, looked up again
            placed.__dict__.pop(looked, None)


@dataclass(frozen=True)
class SetModes:
    """Each module's ``training`` flag, in ``module.modules()`` order."""
    modes: tuple

    def apply(self, placed: Any) -> None:
        for m, mode in zip(placed.module.modules(), self.modes, strict=True):
            m.training = mode


@dataclass(frozen=True)
class SetRequiresGrad:
    """Each parameter's ``requires_grad`` (``toggle_optimizer``, ``requires_grad_()`` here)."""
    flags: tuple

    def apply(self, placed: Any) -> None:
        for p, flag in zip(placed.module.parameters(), self.flags, strict=True):
            p.requires_grad_(flag)


@dataclass(frozen=True)
class SetWeights:
    """Weights and buffers written here (SWA, ``load_state_dict``), by state-dict key."""
    weights: dict

    def apply(self, placed: Any) -> None:
        restore(placed.module, self.weights)


class Sent:
    """What the worker was last sent of the module itself: its modes, its parameters'
    ``requires_grad``, its plain attributes, and its weights (each tensor held, by
    version counter; those handed out through ``.data``, by value). Looked at per call,
    cheaply: lists looked up again only when the module's structure changes."""

    def __init__(self, module: torch.nn.Module, name: str = "module",
                 restructured: Any = None):
        self.name = name
        self.shape = Shape(module)
        self.attributes = Attributes(module, name)
        self.tree = tree(module)
        self.on_restructure = restructured  # what the module here redoes after a change
        self.modes: tuple | None = None
        self.flags: tuple | None = None
        self.exposed: dict[int, torch.Tensor] = {}  # id -> value when handed out as .data
        self.remember()

    def remember(self) -> None:
        """The weights here are as over there now."""
        shape = self.shape
        shape.current()
        with plainly():  # (a placed weight's reads go through FreshParameter otherwise)
            self.seen = versions(shape.tensors)  # as self.versions, in shape's order
        self.versions = dict(zip(shape.names, self.seen, strict=True))
        self.held = dict(zip(shape.names, shape.tensors, strict=True))

    def writes(self, ops: list) -> None:
        """Queue a write here since the last sync (SWA, load_state_dict), or a new tensor
        put under a weight's name."""
        shape = self.shape
        moved = shape.current()  # the names looked up again when the structure changed
        if moved:
            self._restructure(ops)
        with plainly():
            now = versions(shape.tensors)
        was = self.exposed  # handed out through .data since the last look
        if not moved and not was and now == self.seen:
            return  # the same tensors, none written since
        with plainly():
            changed = {k: t.detach().clone()
                       for k, t, v in zip(shape.names, shape.tensors, now, strict=True)
                       if v != self.versions.get(k) or self.held.get(k) is not t
                       or (id(t) in was and not torch.equal(t, was[id(t)]))}
            self.exposed = {}
        if changed:
            ops.append(SetWeights(changed))
            self.remember()
        else:
            self.seen = now  # each as self.versions has it

    def _restructure(self, ops: list) -> None:
        # what changed on the modules as they were goes first, then the structure
        module = self.shape.module
        changes = restructured(self.tree, module)
        if changes:
            attrs = self.attributes.changed()
            if attrs is not None:
                ops.append(attrs)
            try:
                blob = dumps(changes)
            except Exception as e:
                paths = ", ".join(f"{self.name}.{p}" if p else self.name for p in changes)
                raise Refused(
                    f"a child, parameter or buffer was registered here on {paths}, placed on "
                    f"a worker, and cannot be sent there ({type(e).__name__}: {e}): "
                    f"register what pickles, before fit, or leave {self.name!r} unplaced"
                ) from None
            ops.append(SetStructure(blob))
            self.attributes.look(module)
            self.modes = None  # sent again: the modules are others
            self.flags = None
        self.tree = tree(module)
        if self.on_restructure is not None:
            self.on_restructure()

    def settings(self, ops: list) -> None:
        """Queue the modes, ``requires_grad`` flags and plain attributes (a dropout's
        ``p``) changed here since last sent (the structure as ``writes`` looked it up)."""
        with plainly():
            flags = list(map(_REQUIRES_GRAD, self.shape.params))  # (at C speed)
        if flags != self.flags:
            ops.append(SetRequiresGrad(tuple(flags)))
            self.flags = flags
        attributes = self.attributes
        if attributes.quiet() and self.modes is not None:
            return  # no module's __dict__ holds another value (its mode is in it)
        modes = tuple(m.training for m in self.shape.modules)
        if modes != self.modes:
            ops.append(SetModes(modes))
            self.modes = modes
        attrs = attributes.changed()
        if attrs is not None:
            ops.append(attrs)
