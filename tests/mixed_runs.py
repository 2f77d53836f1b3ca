"""A LightningModule that uses both routes at once, plain and under SomatizeStrategy, in
a fresh process (RPC starts once per process); tests/test_mixed_routes.py reads what it
saves.

    python tests/mixed_runs.py mixed OUT.pt
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch.utils.data as tud
from torch import nn
from torch.nn import functional as F

from examples.digits_graph import Body, Head
from somatize import Graph
from somatize.lightning import SomatizeStrategy
from somatize.torch import GraphModule


class Mixed(pl.LightningModule):
    """A plain submodule placed by name (``encoder``) feeding a GraphModule whose body
    node is placed with ``.at("worker")``; the head runs here."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.net = GraphModule(Graph.somatize(Body(32).at("worker") >> Head(32)))

    def training_step(self, batch, i):
        x, y = batch
        loss = F.cross_entropy(self.net(self.encoder(x)), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(96, 64, generator=g), torch.randint(0, 10, (96,), generator=g)
    return tud.DataLoader(tud.TensorDataset(x, y), batch_size=16)


def fit(strategy):
    pl.seed_everything(0)
    model, losses = Mixed(), Losses()
    pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, strategy=strategy,
               callbacks=[losses]).fit(model, data())
    return losses.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def mixed(out):
    plain_losses, plain = fit("auto")
    strategy = SomatizeStrategy(place={"encoder": "worker"})
    split_losses, split = fit(strategy)
    pl.seed_everything(0)
    fresh = {k: v.detach().clone() for k, v in Mixed().state_dict().items()}
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "fresh": fresh, "where": strategy.where(), "pid": os.getpid()}, out)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
