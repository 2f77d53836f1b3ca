"""The part of a graph that runs on one worker, with the optimizers that train it there.

Built on the worker through RPC (``rpc.remote(host, Part, ...)``): it runs the
stretches it is sent, keeps what a training step needs for its backward, and steps
its optimizers when the coordinator's optimizer steps.

    part.run(7, ("body",), given={}, inputs={"body": x}, training=True, grad=True)
    part.backward(7, {"body": dy})       # -> {producer: dL/d(what it was given)}
    part.step()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._engine import walk
from .._values import Opaque, bare
from ..torch._graphmodule import _holder


def _leaf(v: Any) -> Any:
    """A received value as the start of a fresh autograd graph, when it is a float tensor."""
    t = bare(v)
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().requires_grad_()
    return t


class Part:
    """The nodes of ``graph`` placed on ``host``, and an optimizer per node trained there."""

    def __init__(self, graph, host: str, factories: Mapping[str, Callable[..., Any]]):
        self.graph = graph
        self.host = host
        self.holders = {n: _holder(graph.catalog[n]) for n in graph.ids
                        if graph.placement.get(n) == host}
        # built here, on the machine where the parameters are
        self.optimizers = {n: f(list(self.holders[n].parameters())) for n, f in factories.items()}
        self.kept: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}

    def run(self, sid: int, nodes: tuple[str, ...], given: Mapping[str, Any],
            inputs: Mapping[str, Any], wanted: tuple[str, ...], training: bool,
            grad: bool) -> dict[str, Any]:
        """Run a stretch; with ``grad``, keep its inputs and outputs for ``backward(sid)``."""
        with torch.set_grad_enabled(grad):
            leaves = {p: _leaf(v) for p, v in given.items()} if grad else dict(given)
            out = walk(self.graph, nodes, inputs=inputs, given=leaves, here=self.host,
                       training=training, wanted=wanted)
            values = {n: bare(out.values[n]) for n in wanted}
        if grad:
            self.kept[sid] = (leaves, {n: v for n, v in values.items()
                                       if isinstance(v, torch.Tensor) and v.requires_grad})
        return {n: Opaque(v.detach()) if isinstance(v, torch.Tensor) else v
                for n, v in values.items()}

    def backward(self, sid: int, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Backward from the stretch's outputs; answer dL/d(each value it was given)."""
        leaves, outs = self.kept.pop(sid)
        names = [n for n in grads if n in outs]
        if names:
            torch.autograd.backward([outs[n] for n in names], [grads[n] for n in names])
        return {p: t.grad for p, t in leaves.items()
                if isinstance(t, torch.Tensor) and t.grad is not None}

    def forget(self) -> None:
        """Drop what was kept for steps that will get no backward."""
        self.kept.clear()

    def step(self) -> None:
        """Step every optimizer here, then clear the gradients (as Lightning does locally)."""
        for opt in self.optimizers.values():
            opt.step()
            opt.zero_grad()

    def weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each node's state_dict, as the coordinator's GraphModule names it."""
        return {n: {k: v.detach().clone() for k, v in h.state_dict().items()}
                for n, h in self.holders.items() if h is not None}

    def optimizer_states(self) -> dict[str, Any]:
        return {n: opt.state_dict() for n, opt in self.optimizers.items()}

    def load_optimizer_states(self, states: Mapping[str, Any]) -> None:
        for n, state in states.items():
            self.optimizers[n].load_state_dict(state)
