"""The example as a somatize graph, for the graph route: ``Body().at("worker") >> Head()``
in a ``GraphModule``, the same layers as ``digits.DigitsModel`` written as nodes that
declare where they run.

    model = DigitsGraphModel(body_at="worker")     # placement is a request
    lightning.Trainer(max_epochs=1, strategy="somatize").fit(model, DigitsData())
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from somatize import Done, Graph, Node, Opaque
from somatize.torch import GraphModule

log = logging.getLogger(__name__)


class Body(Node):
    """The encoder: 64 pixels to ``hidden`` features."""

    def __init__(self, hidden: int = 32):
        self.lin = nn.Linear(64, hidden)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x).relu()))

    def parameters(self):
        return list(self.lin.parameters())


class Head(Node):
    """The classifier: ``hidden`` features to ten digits' logits."""

    def __init__(self, hidden: int = 32):
        self.lin = nn.Linear(hidden, 10)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


def digits_graph(hidden: int = 32, body_at: str | None = "worker", frozen: bool = False,
                 cached: bool = False, salt: str | None = None) -> Graph:
    """The example's graph: ``Body().at(body_at) >> Head()``, the body maybe frozen and cached."""
    body = Body(hidden).at(body_at)
    if frozen:
        body.frozen()
    if cached:
        body.cached(salt=salt)
    return Graph.somatize(body >> Head(hidden))


class DigitsGraphModel(pl.LightningModule):
    """The example as a graph: ``Body().at(body_at) >> Head()`` in a ``GraphModule``, trained
    with cross-entropy and SGD (the graph route, where nodes declare their placement).

    Args:
        hidden: the width of the encoder's output.
        body_at: the worker the body asks to run on (only ``SomatizeStrategy`` obeys).
        frozen, cached: declare the body ``.frozen()`` / ``.cached()`` (see ``SomatizeCache``).
        body_from: a Lightning checkpoint to take the body's weights from.
        lr, momentum: the SGD optimizer's hyper-parameters.
    """

    def __init__(self, hidden: int = 32, body_at: str | None = "worker", frozen: bool = False,
                 cached: bool = False, body_from: str | None = None, lr: float = 0.1,
                 momentum: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.net = GraphModule(digits_graph(hidden, body_at, frozen, cached))
        if body_from:
            state = torch.load(body_from, map_location="cpu", weights_only=True)["state_dict"]
            prefix = "net.nodes.body."
            self.net.nodes["body"].load_state_dict(
                {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            log.info("body weights taken from %s", body_from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]).argmax(-1)

    def configure_optimizers(self):
        params = [p for p in self.net.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.lr, momentum=self.hparams.momentum)
