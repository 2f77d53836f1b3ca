"""Tiny models shared by the tests: the seeds' Body and Head (seeded, or with
``seed=None`` drawn from torch's generator as it stands), a Pre above them, the cache
tests' counted nodes, a few odd nodes, and twin graphs to train in pieces and whole.

    g = Graph.somatize(Body().at("gpu") >> Head())            # the same weights every time
    whole, split = twins(lambda: Pre() >> Body(seed=None) >> Head(seed=None))
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import torch
from torch import nn

from somatize import Done, Graph, Node, Opaque


class Body(Node):
    """The seeds' body: a linear layer and a relu; no super().__init__().

    ``seed=None`` draws the weights from torch's generator as it stands.
    """

    def __init__(self, seed: int | None = 0, n_in: int = 8, n_out: int = 6):
        if seed is not None:
            torch.manual_seed(seed)
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x).relu()))

    def parameters(self):
        return list(self.lin.parameters())


class Head(Node):
    """The seeds' head: a linear layer to 3 classes (``seed=None`` as for Body)."""

    def __init__(self, seed: int | None = 1, n_in: int = 6):
        if seed is not None:
            torch.manual_seed(seed)
        self.lin = nn.Linear(n_in, 3)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


class Scale(Node):
    """Multiplies by a constant; counts its runs (in the process it runs in)."""

    runs = 0

    def __init__(self, k: float = 2.0):
        self.k = k

    def forward(self, x, ctx):
        type(self).runs += 1
        return Done(Opaque(x * self.k))


class Locked(Node):
    """Answers something that cannot travel: a lock beside the tensor."""

    def forward(self, x, ctx):
        return Done(Opaque((threading.Lock(), x)))


class Unlock(Node):
    """Reads what Locked left and answers the tensor inside."""

    def forward(self, x, ctx):
        _, t = x
        return Done(Opaque(t + 1))


class Where(Node):
    """Answers the pid of the process it ran in."""

    def forward(self, x, ctx):
        return Done(os.getpid())


class Boom(Node):
    """Raises inside its forward."""

    def forward(self, x, ctx):
        raise ValueError("boom inside the node")


class Sleepy(Node):
    """Writes its pid to ``path`` and sleeps: a node to kill a worker in the middle of.
    Its first ``skip`` runs go straight through."""

    def __init__(self, path: str, seconds: float = 60.0, skip: int = 0):
        self.path, self.seconds, self.skip = path, seconds, skip

    def forward(self, x, ctx):
        if self.skip > 0:
            self.skip -= 1
            return Done(x)
        with open(self.path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(self.path + ".tmp", self.path)
        time.sleep(self.seconds)
        return Done(x)


class Holding(Node):
    """Holds a lock (it does not pickle) and answers its input plus one."""

    def __init__(self):
        self.lock = threading.Lock()

    def forward(self, x, ctx):
        with self.lock:
            return Done(Opaque(x + 1))


class Nap(Node):
    """Sleeps here, in the coordinator: a node to interrupt the coordinator in."""

    def __init__(self, seconds: float = 60.0):
        self.seconds = seconds

    def forward(self, x, ctx):
        time.sleep(self.seconds)
        return Done(x)


class Pre(Node):
    """Something with weights above the trained node (here, in one piece)."""

    def __init__(self, n: int = 8):
        self.lin = nn.Linear(n, n)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x).tanh()))

    def parameters(self):
        return list(self.lin.parameters())


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


# -- the cache tests' nodes: each counts its runs in ``RUNS`` by node id --------------

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


class Stem(Encoder):
    """Another stateful node, to stand upstream of the encoder (counted as well)."""

    def __init__(self, seed: int = 1):
        super().__init__(seed, 4, 4)


class Probe(Node):
    """The part that trains on the encoder: a linear layer (counted as well)."""

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
    """Reads the tensor out of a Handle."""

    def forward(self, x, ctx):
        RUNS[ctx.node] += 1
        return Done(Opaque(x.t + 1))


class ToHandle(Node):
    """Wraps its input in a Handle."""

    def forward(self, x, ctx):
        RUNS[ctx.node] += 1
        return Done(Opaque(Handle(x)))
