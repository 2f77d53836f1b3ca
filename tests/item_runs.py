"""Runs for per-item memory (tests/test_per_item.py): the example model with a body that
counts the rows it computes inside its own forward (in the process that runs it), fitted
on shuffled digits under a real lightning.Trainer, with ``SomatizeCache(per_item=True)``
or with the hand-written oracle; the placed run starts RPC, so it runs in its own process.

    python tests/item_runs.py placed OUT.pt STORE LOG
"""

import os
import sys

import lightning.pytorch as pl
import oracle as kit  # its fit and weights ("oracle" here is the run by hand)
import torch
from torch import nn

from examples.digits import DigitsData, DigitsModel
from somatize.lightning import SomatizeCache, SomatizeStrategy


class CountingBody(nn.Module):
    """The example's body, writing ``pid rows`` to a file each time it computes."""

    def __init__(self, log: str):
        super().__init__()
        self.lin = nn.Linear(64, 32)
        self.log = log

    def forward(self, x):
        with open(self.log, "a") as f:
            # distinct rows: per item pads its misses to chunks of 32 with copies of a row
            f.write(f"{os.getpid()} {torch.unique(x, dim=0).shape[0]}\n")
        return self.lin(x).relu()


class Model(DigitsModel):
    def __init__(self, log: str):
        super().__init__(lr=0.5, momentum=0.9)
        self.body = CountingBody(log)


class Reordered(DigitsData):
    """The same items, in another order each epoch."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        loader.sampler.seed = 1234
        return loader


class FirstSeen:
    """The oracle, by hand: each item's output the first time it is seen (the unseen rows
    of a batch computed together, in order), and that row reused ever after."""

    def __init__(self, module: nn.Module):
        self.module, self.rows = module, {}

    def __call__(self, x):
        keys = [x[i].numpy().tobytes() for i in range(len(x))]
        new = list(dict.fromkeys(k for k in keys if k not in self.rows))
        if new:
            at = [keys.index(k) for k in new]
            out = type(self.module).forward(self.module, x if len(at) == len(x) else x[at])
            for k, row in zip(new, out, strict=True):
                self.rows[k] = row.clone()
        return torch.stack([self.rows[k] for k in keys])


def fit(log, strategy="auto", callbacks=(), oracle=False, data=DigitsData, epochs=3, **kw):
    """Shuffled digits (64 training items in batches of 16, 256 validation items)."""
    pl.seed_everything(0)
    model = Model(log)
    if oracle:  # what the cache does, done by hand on a plain Lightning run
        model.body.requires_grad_(False).eval()
        model.body.forward = FirstSeen(model.body)
    _, losses = kit.fit(model, strategy, data(batch_size=16, limit=64, shuffle=True),
                           max_epochs=epochs, limit_val_batches=1, num_sanity_val_steps=0,
                           callbacks=callbacks, **kw)
    return losses, {k: v for k, v in kit.weights(model).items() if k.startswith("head.")}


def computed(log) -> dict[int, int]:
    """Rows the body computed, by the process that computed them."""
    out: dict[int, int] = {}
    if os.path.exists(log):
        for line in open(log).read().split("\n"):
            if line:
                pid, n = map(int, line.split())
                out[pid] = out.get(pid, 0) + n
    return out


def placed(out, store, log):
    oracle = fit(log + ".oracle", oracle=True)
    cache = SomatizeCache(store, modules=["body"], per_item=True)
    first = fit(log, SomatizeStrategy(place={"body": "worker"}), [cache])
    counts = (cache.hits, cache.misses)
    done = computed(log)
    open(log, "w").close()  # the same path again: the body's attributes are in its name
    again = fit(log, SomatizeStrategy(place={"body": "worker"}),
                [SomatizeCache(store, modules=["body"], per_item=True)], data=Reordered)
    torch.save({"oracle": oracle, "first": first, "again": again, "counts": counts,
                "computed": done, "computed_again": computed(log), "pid": os.getpid()}, out)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
