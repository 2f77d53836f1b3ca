"""Split learning: the trainer that ships. It keeps the activation between the forward
and the gradient, holds its own optimizer over the weights where the node runs, and
answers dL/d(input) to whoever fed it.

    trains = {"body": Split(SGD, lr=0.1)}       # the optimizer is built there, at first use
    Trainer(g, objective, optimizer, trains=trains).fit(data, epochs=10)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._learning import Learning
from .._node import Ctx
from .._trace import span


class Split(Learning):
    """Train a node where it runs with its own optimizer, built from ``optimizer_factory(**kw)``.

    Args:
        optimizer_factory: a class or function taking the node's parameters (it must
            pickle: a class, a module-level function or a ``functools.partial``).
        **kw: its hyper-parameters (``lr=0.1``).
    """

    # read by a rebuilt object: class attributes, never set only in __init__
    factory: Callable[..., torch.optim.Optimizer] | None = None
    _optimizer: torch.optim.Optimizer | None = None
    _x: torch.Tensor | None = None  # the leaf made of the input (for dL/dx)
    _y: Any = None  # the activation, kept until its gradient comes back

    def __init__(self, optimizer_factory: Callable[..., torch.optim.Optimizer], **kw: Any):
        self.factory = functools.partial(optimizer_factory, **kw) if kw else optimizer_factory

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
        self._y = y
        return y.detach()

    def learn(self, signal: Any, ctx: Ctx) -> Any:
        x, y = self._x, self._y
        self._x = self._y = None
        if signal is None or y is None:
            return None  # nothing handed back: the weights stay where they were
        optimizer = self.optimizer
        torch.autograd.backward(y, signal)
        if not self.accumulates:
            with span(f"optimizer step {ctx.node}", "step"):
                optimizer.step()
            optimizer.zero_grad()
        return x.grad if x is not None and x.requires_grad else None

    def step(self) -> None:
        with span("optimizer step", "step"):
            self.optimizer.step()
        self.optimizer.zero_grad()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_x", None)  # what is kept between two calls does not travel
        state.pop("_y", None)
        return state

    def __repr__(self) -> str:
        return f"Split({self.factory!r})"
