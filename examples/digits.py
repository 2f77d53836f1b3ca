"""The example: an encoder (the body) and a classifier head on scikit-learn's digits
(8x8 images shipped with scikit-learn, nothing downloaded), as a plain LightningModule
and its data; this file imports nothing from somatize. The strategy places the body
by name (the same model as a somatize graph is in ``digits_graph.py``).

    model = DigitsModel()
    lightning.Trainer(max_epochs=1).fit(model, DigitsData())                      # one piece
    lightning.Trainer(max_epochs=1, strategy=SomatizeStrategy(place={"body": "worker"})
                      ).fit(model, DigitsData())                                  # split
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

log = logging.getLogger(__name__)


class DigitsModel(pl.LightningModule):
    """Body and head trained with cross-entropy and SGD: plain Lightning, knowing nothing
    of where its modules run.

    Args:
        hidden: the width of the encoder's output.
        body_from: a Lightning checkpoint to take the body's weights from (its
            ``body.*`` entries, as this model and the drop-in strategy write them).
        lr, momentum: the SGD optimizer's hyper-parameters.
    """

    def __init__(self, hidden: int = 32, body_from: str | None = None, lr: float = 0.1,
                 momentum: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)
        if body_from:
            state = torch.load(body_from, map_location="cpu", weights_only=True)["state_dict"]
            self.body.load_state_dict(
                {k[len("body."):]: v for k, v in state.items() if k.startswith("body.")})
            log.info("body weights taken from %s", body_from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        # what requires a gradient: a frozen body (a cached one) is left out
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.lr, momentum=self.hparams.momentum)


class ResumableLoader(DataLoader):
    """A DataLoader whose place in the epoch goes into Lightning's checkpoints: a run
    stopped mid-epoch resumes at the batch it had reached (Lightning 2.6 saves the
    ``state_dict`` of a training loader that has one, and loads it before iterating)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.served = 0  # batches handed out in this pass
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        # a generator: the sampler's order is read at the first batch, after Lightning
        # has set its epoch
        skip, self._skip = self._skip, 0
        self.served = 0
        for batch in super().__iter__():
            self.served += 1
            if self.served > skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        """How far into the epoch this loader is (0 once an epoch is complete)."""
        return {"served": self.served if self.served < len(self) else 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start the next pass where ``state`` says (the same epoch's order, later on)."""
        self._skip = state["served"]


class DigitsData(pl.LightningDataModule):
    """scikit-learn's digits, scaled to [0, 1], split 80/20 with a fixed seed.

    Args:
        batch_size: samples per batch.
        limit: keep only the first ``limit`` training samples (short tests).
        seed: the split's and the shuffle's seed; each epoch's order depends on it alone,
            so a run resumed at an epoch boundary sees the same batches.
        shuffle: a new order each epoch; off, every epoch sees the same batches (which
            a cached encoder's outputs are named by).
    """

    def __init__(self, batch_size: int = 64, limit: int | None = None, seed: int = 0,
                 shuffle: bool = True):
        super().__init__()
        self.shuffle = shuffle
        self.batch_size = batch_size
        self.limit = limit
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y, dtype=torch.int64)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        cut = int(0.8 * len(x))
        train, val = order[:cut], order[cut:]
        if self.limit:
            train = train[: self.limit]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])

    def train_dataloader(self) -> DataLoader:
        # an epoch-seeded order (set_epoch is called by Lightning), not the global RNG's
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=self.shuffle,
                                     seed=self.seed)
        return ResumableLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

