"""Tiny nodes for the training tests: the seed's Body and Head, a Pre above them, and
two identical copies of a graph so one can be trained in pieces and one whole.

    whole, split = twins(lambda: Pre() >> Body() >> Head())
"""

from __future__ import annotations

import models
import torch
from torch import nn

from somatize import Done, Graph, Node, Opaque


class Pre(Node):
    """Something with weights above the trained node (here, in one piece)."""

    def __init__(self, n: int = 8):
        self.lin = nn.Linear(n, n)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x).tanh()))

    def parameters(self):
        return list(self.lin.parameters())


class Body(models.Body):
    """The seeds' body, its weights drawn from torch's generator as it stands."""

    def __init__(self, n_in: int = 8, n_out: int = 6):
        super().__init__(None, n_in, n_out)


class Head(models.Head):
    """The seeds' head, its weights drawn from torch's generator as it stands."""

    def __init__(self, n_in: int = 6):
        super().__init__(None, n_in)


class Drop(Node):
    """Dropout (half the values, scaled), drawn from torch's generator while training."""

    def forward(self, x, ctx):
        return Done(Opaque(torch.nn.functional.dropout(x, 0.5, training=ctx.training)))

    def parameters(self):
        return []


class Mute(Node):
    """Has weights but does not say so (no parameters())."""

    def __init__(self):
        self.lin = nn.Linear(8, 8)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x)))


def batches(n: int = 10, size: int = 16, dim: int = 8, seed: int = 0):
    """``n`` batches of ``(input, target)`` with 3 classes."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, dim, generator=gen), torch.randint(0, 3, (size,), generator=gen))
            for _ in range(n)]


def twins(build, seed: int = 0) -> tuple[Graph, Graph]:
    """Two graphs with the same weights, from ``build()`` returning a composition."""
    torch.manual_seed(seed)
    one = Graph.somatize(build())
    other = Graph.somatize(build())
    for n, node in one.catalog.items():
        for a, b in zip(node.parameters(), other.catalog[n].parameters(), strict=True):
            with torch.no_grad():
                b.copy_(a)
    return one, other


def weights(graph: Graph) -> dict[str, list[torch.Tensor]]:
    """Every node's parameters, by node id (copies)."""
    return {n: [p.detach().clone() for p in node.parameters()]
            for n, node in graph.catalog.items() if hasattr(node, "parameters")}


def same(a, b) -> bool:
    """Bit for bit: the same keys and torch.equal tensors, nested."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


