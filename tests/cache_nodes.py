"""Tiny nodes for the cache and store tests; each counts its runs in ``RUNS`` by node id."""

from collections import Counter

import torch
from torch import nn

from somatize import Done, Node, Opaque

RUNS: Counter = Counter()


class Encoder(Node):
    """A stateful node: a linear layer whose weights come from ``seed``."""

    def __init__(self, seed: int = 0, d_in: int = 4, d_out: int = 3):
        torch.manual_seed(seed)
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x, ctx):
        RUNS[ctx.node] += 1
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


class Pre(Encoder):
    """Another stateful node, to stand upstream of the encoder."""

    def __init__(self, seed: int = 1):
        super().__init__(seed, 4, 4)


class Head(Node):
    """The part that trains: a linear layer."""

    def __init__(self, seed: int = 2, d_in: int = 3):
        torch.manual_seed(seed)
        self.lin = nn.Linear(d_in, 2)

    def forward(self, x, ctx):
        RUNS[ctx.node] += 1
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


class Tokenize(Node):
    """A node with no state (a tokenizer): settled by nature."""

    def forward(self, x, ctx):
        RUNS[ctx.node] += 1
        return Done(Opaque(x * 2))


class Handle:
    """A process-local object no codec knows."""

    def __init__(self, t):
        self.t = t


class FromHandle(Node):
    def forward(self, x, ctx):
        RUNS[ctx.node] += 1
        return Done(Opaque(x.t + 1))


class ToHandle(Node):
    def forward(self, x, ctx):
        RUNS[ctx.node] += 1
        return Done(Opaque(Handle(x)))
