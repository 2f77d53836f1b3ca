"""Tiny models shared by the tests: the seeds' Body and Head, and a few odd nodes.

    g = Graph.somatize(Body().at("gpu") >> Head())
"""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

from somatize import Done, Node, Opaque


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
