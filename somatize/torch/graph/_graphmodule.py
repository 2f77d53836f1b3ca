"""A graph as an ``nn.Module``: what a LightningModule holds and calls in ``training_step``.

    self.net = GraphModule(Graph.somatize(Body().at("worker") >> Head()))
    logits = self.net(x)

Under any strategy but ``SomatizeStrategy`` every node runs in this process
(placement is a request only that strategy fulfils), so the same module trains
in one piece or split by changing the strategy alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..._graph import Graph, Placement
from ..._memory import params_of
from .._state import modules_of


def _holder(node: Any) -> nn.Module | None:
    """The module that owns a node's state, or None for a node with none."""
    if isinstance(node, nn.Module):
        return node
    mods = modules_of(node)
    if mods:
        return nn.ModuleDict(dict(mods))
    got = params_of(node)
    return nn.ParameterList(got) if got else None


class GraphModule(nn.Module):
    """An ``nn.Module`` holding a graph: its nodes' weights, ``state_dict``, ``.to()``.

    Args:
        graph: the graph to run; its nodes' modules become submodules under ``nodes.<id>``.
    """

    def __init__(self, graph: Graph):
        super().__init__()
        self.graph = graph
        holders = {n: _holder(node) for n, node in graph.catalog.items()}
        self.nodes = nn.ModuleDict({n: h for n, h in holders.items() if h is not None})
        # placement ignored: what runs when no strategy fulfils it
        self.whole = Graph(graph.catalog, graph.edges, Placement(), graph.memory)
        self.store: Any = None  # a Keeper, attached by SomatizeCache
        self.runner: Callable[..., Any] | None = None  # set by SomatizeStrategy

    def forward(self, x: Any = None, *, feeds: Mapping[str, Any] | None = None) -> Any:
        """Run the graph on ``x`` (or ``feeds={root: x}``); return the sink's value."""
        if self.runner is not None:
            return self.runner(x, feeds=feeds, training=self.training)
        return self.whole.forward(x, store=self.store, feeds=feeds, training=self.training)

    def train(self, mode: bool = True) -> GraphModule:
        """Set training mode; nodes declared ``.frozen()`` stay in eval mode."""
        super().train(mode)
        for n in self.graph.memory.frozen:
            if n in self.nodes:
                self.nodes[n].eval()
        return self

    def __getstate__(self):
        state = self.__dict__.copy()
        state["runner"] = None
        return state
