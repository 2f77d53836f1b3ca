"""The main job (README's first command): for now, a small graph run end to end.

    bash scripts/run.sh
"""

import torch
from torch import nn

from somatize import Done, Graph, Node, Opaque


class Body(Node):
    def __init__(self):
        self.lin = nn.Linear(8, 6)

    def forward(self, x, ctx):
        print(f"  {ctx.node} ran on {ctx.host or 'the coordinator'}")
        return Done(Opaque(self.lin(x).relu()))


def main():
    torch.manual_seed(0)
    g = Graph.somatize(Body() >> nn.Linear(6, 3))
    print(g.describe())
    y = g.forward(torch.randn(4, 8))
    print("output", tuple(y.shape))


if __name__ == "__main__":
    main()
