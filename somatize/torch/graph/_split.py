"""Split learning: the trainer that ships. It keeps the activation between the forward
and the gradient, holds its own optimizer over the weights where the node runs, and
answers dL/d(input) to whoever fed it.

    trains = {"body": Split(SGD, lr=0.1)}       # the optimizer is built there, at first use
    Trainer(g, objective, optimizer, trains=trains).fit(data, epochs=10)
    Split(SGD, lr=0.1, wire=torch.bfloat16)     # activations and gradients cross in bf16

With micro-batches several forwards await their gradient at once (``in_flight``): each
keeps its own activation, and ``learn`` answers them oldest first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..._errors import Refused
from ..._learning import Learning
from ..._node import Ctx
from ..._trace import span
from ..._values import Opaque, bare


class Split(Learning):
    """Train a node where it runs with its own optimizer, built from ``optimizer_factory(**kw)``.

    Args:
        optimizer_factory: a class or function taking the node's parameters (it must
            pickle: a class, a module-level function or a ``functools.partial``).
        wire: a narrower floating dtype (``torch.bfloat16``) that activations and
            gradients cross the cut in, cast back on arrival: half the bytes, not
            bit-identical. None (the default) sends them as they are.
        **kw: its hyper-parameters (``lr=0.1``).
    """

    # read by a rebuilt object: class attributes, never set only in __init__
    factory: Callable[..., torch.optim.Optimizer] | None = None
    _optimizer: torch.optim.Optimizer | None = None
    _x: torch.Tensor | None = None  # the leaf made of the input (for dL/dx), until leave
    # (input leaf, activation) per forward awaiting its gradient, oldest first; a tuple,
    # so that a copy of this trainer never shares it
    _kept: tuple = ()

    def __init__(self, optimizer_factory: Callable[..., torch.optim.Optimizer], *,
                 wire: torch.dtype | None = None, **kw: Any):
        self.factory = functools.partial(optimizer_factory, **kw) if kw else optimizer_factory
        if wire is not None:
            if not isinstance(wire, torch.dtype) or not wire.is_floating_point:
                raise Refused(f"Split(wire={wire!r}): give the floating dtype activations "
                              "and gradients cross the cut in, e.g. wire=torch.bfloat16")
            self.wire = wire

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the trained node's weights, built at first use, where they are."""
        if self._optimizer is None:
            self._optimizer = self.factory(list(self.node.parameters()))
        return self._optimizer

    def enter(self, x: Any, ctx: Ctx) -> Any:
        if not ctx.training or not isinstance(x, torch.Tensor):
            return x
        # a leaf, so that dL/dx can be asked of it; asked only if someone upstream wants it
        self._x = x.detach().requires_grad_(self.feeds_back and x.is_floating_point())
        return self._x

    def leave(self, y: Any, ctx: Ctx) -> Any:
        if not ctx.training or not isinstance(y, torch.Tensor):
            return y
        # beyond in_flight, the oldest forward got no backward (a discarded step): forgotten
        self._kept = (*self._kept, (self._x, y))[-self.in_flight:]
        self._x = None
        return narrowed(y.detach(), self.wire)

    def learn(self, signal: Any, ctx: Ctx) -> Any:
        if not self._kept:
            return None  # no forward awaits a gradient
        (x, y), self._kept = self._kept[0], self._kept[1:]
        if signal is None:
            return None  # nothing handed back: the weights stay where they were
        torch.autograd.backward(y, bare(signal))  # bare: cast back if it crossed narrowed
        if not self.accumulates:
            optimizer = self.optimizer
            with span(f"optimizer step {ctx.node}", "step"):
                optimizer.step()
            optimizer.zero_grad()
        return narrowed(x.grad, self.wire) if x is not None and x.requires_grad else None

    def step(self) -> None:
        with span("optimizer step", "step"):
            self.optimizer.step()
        self.optimizer.zero_grad()

    def forget(self) -> None:
        self._x, self._kept = None, ()
        if self._optimizer is not None:
            self._optimizer.zero_grad()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_x", None)  # what is kept between two calls does not travel
        state.pop("_kept", None)
        return state

    def __repr__(self) -> str:
        wire = "" if self.wire is None else f", wire={self.wire}"
        return f"Split({self.factory!r}{wire})"


class Narrowed(Opaque):
    """A floating tensor sent in a narrower dtype: ``.value`` is it cast back to the dtype
    it had (once, where it is read); what pickles is the narrow tensor and that dtype."""

    __slots__ = ("narrow", "dtype", "_wide")

    def __init__(self, narrow: torch.Tensor, dtype: torch.dtype):
        self.narrow, self.dtype, self._wide = narrow, dtype, None

    @property
    def value(self) -> torch.Tensor:
        if self._wide is None:
            self._wide = self.narrow.to(self.dtype)
        return self._wide

    def __reduce__(self):
        return Narrowed, (self.narrow, self.dtype)

    def __repr__(self) -> str:
        return f"Narrowed({self.dtype} as {self.narrow.dtype})"


def narrowed(t: Any, wire: torch.dtype | None) -> Any:
    """``t`` as it crosses the cut: a floating tensor wider than ``wire`` goes ``Narrowed``;
    anything else (None, ``wire=None``) as it is."""
    if (wire is None or not isinstance(t, torch.Tensor) or not t.is_floating_point()
            or t.element_size() <= wire.itemsize):
        return t
    return Narrowed(t.detach().to(wire), t.dtype)
