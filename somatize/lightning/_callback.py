"""``SomatizeCache``: the Lightning callback that settles what a graph declares frozen,
checks the prefix rule before the first batch, and keeps cached nodes' outputs in a store.

    trainer = lightning.Trainer(callbacks=[SomatizeCache(store="/scratch/soma")])
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from os import PathLike
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from .._keeper import Kept
from .._memory import cacheable
from ..torch import GraphModule, freeze

log = logging.getLogger(__name__)


class Counting:
    """A keeper that counts what it was asked: a hit is a name found, a miss one not."""

    def __init__(self, keeper: Any):
        self.keeper = keeper
        self.hits = 0
        self.misses = 0

    def get_many(self, names: Sequence[str]) -> list[Kept | None]:
        got = self.keeper.get_many(names)
        found = sum(g is not None for g in got)
        self.hits += found
        self.misses += len(got) - found
        return got

    def put(self, name: str, value: Any, meta: Mapping[str, str] | None = None) -> bool:
        return self.keeper.put(name, value, meta)

    def names(self, prefix: str = "") -> Iterator[str]:
        return self.keeper.names(prefix)


def graph_modules(module: Any) -> list[GraphModule]:
    """Every ``GraphModule`` inside a LightningModule."""
    return [m for m in module.modules() if isinstance(m, GraphModule)]


class SomatizeCache(pl.Callback):
    """Settle frozen nodes, refuse a cache the prefix rule forbids, keep cached outputs.

    Hits and misses are logged each epoch (``cache/hits``, ``cache/misses``); their
    totals are kept in checkpoints.

    Args:
        store: a directory (created if missing) or a Keeper where cached outputs are kept.
    """

    def __init__(self, store: str | PathLike | Any):
        self.store = store
        self.keeper: Counting | None = None
        self.hits = 0  # totals over every epoch, resumed from checkpoints
        self.misses = 0
        self._seen = (0, 0)

    def _attach(self, pl_module: pl.LightningModule) -> None:
        if self.keeper is None:
            from ..store import open_keeper

            self.keeper = Counting(open_keeper(self.store))
        for gm in graph_modules(pl_module):
            gm.store = self.keeper

    def _settle(self, pl_module: pl.LightningModule) -> None:
        for gm in graph_modules(pl_module):
            freeze(gm.graph)  # again after a checkpoint's weights were restored: a new digest
            if gm.graph.memory.cached:
                cacheable(gm.graph)
            gm.train(gm.training)  # frozen nodes back to eval mode

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # before the optimizers are built, so frozen weights are not handed to them
        self._settle(pl_module)
        self._attach(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen = self._counts()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hits, misses = (now - then for now, then in zip(self._counts(), self._seen, strict=True))
        self.hits += hits
        self.misses += misses
        self._seen = self._counts()
        pl_module.log_dict({"cache/hits": float(hits), "cache/misses": float(misses)},
                           on_epoch=True, on_step=False)
        log.info("epoch %d: %d cached outputs found, %d computed", trainer.current_epoch,
                 hits, misses)

    def _counts(self) -> tuple[int, int]:
        k = self.keeper
        return (k.hits, k.misses) if k is not None else (0, 0)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "store": str(self.store)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.hits = state_dict["hits"]
        self.misses = state_dict["misses"]
        if state_dict.get("store") != str(self.store):
            log.info("resuming with store %s (the checkpoint was written with %s)",
                     self.store, state_dict.get("store"))
