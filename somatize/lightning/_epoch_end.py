"""The strategy's own callback, first in the list: as an epoch ends, the placed weights
here brought up to date, and the epoch's traffic logged.

    trainer.callbacks.insert(0, _EpochEnd())   # done by SomatizeStrategy.setup
"""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from ._quiet import Quiet


class _EpochEnd(Quiet):
    """As an epoch ends, before the user's callbacks: the placed modules' weights here
    brought up to date, and the epoch's traffic logged: ``somatize/wait_ms`` (this
    process waiting on workers), ``somatize/bytes_sent``, ``somatize/bytes_received``."""

    def __init__(self):
        self.seen = (0.0, 0, 0)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = trainer.strategy.traffic()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        strategy.sync()
        now = strategy.traffic()
        waited, sent, received = (a - b for a, b in zip(now, self.seen, strict=True))
        self.seen = now
        if strategy.routes:
            pl_module.log_dict({"somatize/wait_ms": waited * 1000.0,
                                "somatize/bytes_sent": float(sent),
                                "somatize/bytes_received": float(received)},
                               on_step=False, on_epoch=True)
