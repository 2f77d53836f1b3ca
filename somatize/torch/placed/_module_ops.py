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

from dataclasses import dataclass
from typing import Any

import torch

from .._private import plainly, versions
from .._state import restore
from ._ordinary import Attributes, Shape


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

    def __init__(self, module: torch.nn.Module):
        self.shape = Shape(module)
        self.attributes = Attributes(module)
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

    def settings(self, ops: list) -> None:
        """Queue the modes, ``requires_grad`` flags and plain attributes (a dropout's
        ``p``) changed here since last sent (the structure as ``writes`` looked it up)."""
        modes = tuple(m.training for m in self.shape.modules)
        if modes != self.modes:
            ops.append(SetModes(modes))
            self.modes = modes
        with plainly():
            flags = tuple(p.requires_grad for p in self.shape.params)
        if flags != self.flags:
            ops.append(SetRequiresGrad(flags))
            self.flags = flags
        attrs = self.attributes.changed()
        if attrs is not None:
            ops.append(attrs)
