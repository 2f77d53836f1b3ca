"""Runs of a real lightning.Trainer on unmodified LightningModules, plain and with
SomatizeStrategy(place=...), each in its own process (RPC starts once per process);
tests/test_dropin.py calls them and reads what they save. This script plays every run of
tests/dropin_*_runs.py (models in tests/dropin_models.py), several in one process with
``many``; its own run's argument class is defined here, in ``__main__``.

    python tests/dropin_runs.py transformer OUT.pt
"""

import collections
import os
import sys
import types

import dropin_exact_runs
import dropin_precision_runs
import dropin_refusal_runs
import dropin_resume_runs
import lightning.pytorch as pl
import torch
from dropin_models import digits, fit
from torch import nn
from torch.nn import functional as F

from somatize.lightning import SomatizeStrategy

# every run of tests/dropin_*_runs.py, played by name here (and by ``many``)
for _runs in (dropin_exact_runs, dropin_precision_runs, dropin_refusal_runs, dropin_resume_runs):
    globals().update({n: f for n, f in vars(_runs).items()
                      if isinstance(f, types.FunctionType) and f.__module__ == _runs.__name__})


Pair = collections.namedtuple("Pair", "a b")  # defined in __main__: not importable there


class PairEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, pair):
        return self.lin(pair.a) + self.lin(pair.b)


class TakesPairs(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = PairEncoder()
        self.head = nn.Linear(8, 64)

    def training_step(self, batch, i):
        x = batch[0]
        return F.mse_loss(self.head(self.encoder(Pair(x, x.flip(0)))), x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def unreadable(out):
    """An argument whose class the script defines (in __main__): it crosses by value, and
    trains as in one piece."""
    pl.seed_everything(0)
    _, plain_losses, plain = fit(TakesPairs(), "auto", digits(), max_steps=4)
    pl.seed_everything(0)
    _, split_losses, split = fit(TakesPairs(), SomatizeStrategy(place={"encoder": "worker"}),
                                 digits(), max_steps=4)
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split)}, out)


def many(out, *cases):
    """Several runs in one process (one interpreter start, RPC started once), each saved
    beside ``out`` as ``<case>.pt``: ``transformer``, ``precision:bf16``, ..."""
    for case in cases:
        name, _, arg = case.partition(":")
        path = os.path.join(os.path.dirname(out), f"{case.replace(':', '-')}.pt")
        globals()[name](path, *([arg] if arg else []))
    torch.save(list(cases), out)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
