"""Runs of a real lightning.Trainer with ``SomatizeCache(modules=["body"])`` on the plain
example model; the placed one starts RPC, so it runs in its own process and
tests/test_dropin_cache.py reads what it saves.

    python tests/cache_runs.py placed OUT.pt STORE
"""

import os
import sys

import lightning.pytorch as pl
import oracle
import torch

from examples.digits import DigitsData, DigitsModel
from somatize.lightning import SomatizeCache, SomatizeStrategy


class CountsHere(pl.Callback):
    """What the cached forward in this process counted, as training ends."""

    def __init__(self, cache: SomatizeCache):
        self.cache, self.here = cache, None

    def on_train_end(self, trainer, pl_module):
        self.here = {p: (c.hits, c.misses) for p, c in self.cache.cached.items()}


def fit(strategy="auto", callbacks=(), frozen_by_hand=False, **kw):
    """Two epochs of the example, the same two batches each (and one validation batch)."""
    pl.seed_everything(0)
    model = DigitsModel(lr=0.5, momentum=0.9)
    if frozen_by_hand:  # what SomatizeCache does to the body, done as plain Lightning would
        model.body.requires_grad_(False).eval()
    trainer, losses = oracle.fit(model, strategy, DigitsData(batch_size=32, limit=64,
                                                              shuffle=False),
                                 max_epochs=2, limit_val_batches=1, num_sanity_val_steps=0,
                                 callbacks=callbacks, **kw)
    return trainer, losses, oracle.weights(model)


def placed(out, store):
    _, plain_losses, plain = fit(frozen_by_hand=True)
    cache = SomatizeCache(store, modules=["body"])
    here = CountsHere(cache)
    strategy = SomatizeStrategy(place={"body": "worker"})
    _, losses, weights = fit(strategy, callbacks=[cache, here])
    torch.save({"plain": (plain_losses, plain), "cached": (losses, weights),
                "counts": (cache.hits, cache.misses), "here": here.here,
                "ran": strategy.where(), "pid": os.getpid()}, out)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
