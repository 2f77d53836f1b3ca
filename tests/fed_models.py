"""The tiny models and data the study tests share: a U-shaped LightningModule
(``stem -> trunk -> head``), the trunk the hub builds by reference, each owner's rows.

    model = Net(); loader = owner_loader("a")      # 24 rows for a, 16 for b, 8 for c
"""

import lightning.pytorch as pl
import torch
from torch import nn

ROWS = {"a": 24, "b": 16, "c": 8, "c2": 8}
BATCH = 8


class Trunk(nn.Module):
    """The shared module (the hub imports it as tests.fed_models:Trunk)."""

    def __init__(self, width: int = 128, p: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(p),
                                 nn.Linear(width, width))

    def forward(self, x):
        return self.net(x)


class Net(pl.LightningModule):
    """An owner's whole model; its trunk here is what the hub's starts as."""

    def __init__(self, p: float = 0.0, lr: float = 0.1, width: int = 128):
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.trunk = Trunk(width, p)
        self.head = nn.Linear(width, 3)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.trunk(self.stem(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def owner_loader(owner: str):
    """``owner``'s rows: its own features and labels, never seen by the hub."""
    g = torch.Generator().manual_seed(sum(map(ord, owner)))
    n = ROWS[owner]
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def owner_seed(owner: str) -> int:
    """The seed an owner's model is made under: one for all, the study's common start
    (FedAvg's global model at round 0)."""
    return 1234


def make_net(study_cfg) -> Net:
    """An owner's model for a study: its trunk starts as the hub's does."""
    net = Net(p=float(study_cfg.kwargs.get("p", 0.0)),
              width=int(study_cfg.kwargs.get("width", 128)))
    net.trunk.load_state_dict(study_cfg.build_module().state_dict())
    return net


class DigitsBody(nn.Sequential):
    """examples/digits.py's body (``Sequential(Linear(64, hidden), ReLU())``) as a hub's
    own class: the shared module of a study train.py's ``+somatize=splitfed`` joins. Built
    after ``torch.manual_seed(0)`` it is the body ``python train.py`` (seed 0) starts with."""

    def __init__(self, hidden: int = 32):
        super().__init__(nn.Linear(64, hidden), nn.ReLU())
