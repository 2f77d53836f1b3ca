"""Drop-in runs against plain Lightning bit for bit: each module trained plainly and with
its submodule placed on a worker (tests/test_dropin.py), and the traced fits
(tests/test_trace.py). Run through tests/dropin_runs.py, or alone:

    python tests/dropin_exact_runs.py transformer OUT.pt
"""

import os
import sys

import lightning.pytorch as pl
import torch
from dropin_models import (
    GAN,
    AutoEncoder,
    DemoTransformer,
    Finetuned,
    Many,
    Normed,
    PlainAutoEncoder,
    Siamese,
    TwoOptimizers,
    both,
    digits,
    fit,
)
from torch.nn import functional as F

from somatize.lightning import SomatizeStrategy


def transformer(out):
    both(DemoTransformer, {"model.transformer": "worker"}, out, max_steps=5)


def autoencoder(out):
    both(AutoEncoder, {"encoder": "worker"}, out, digits(), max_epochs=2,
         accumulate_grad_batches=2, limit_val_batches=1)


def manual(out):
    both(TwoOptimizers, {"encoder": "worker"}, out, digits(), max_epochs=1)


def siamese(out):
    both(Siamese, {"encoder": "worker"}, out, digits(), max_epochs=1)


def gan(out):
    both(GAN, {"generator": "worker"}, out, digits(), max_epochs=1)


def finetune(out):
    from lightning.pytorch.callbacks import BackboneFinetuning

    got = {}
    for name, strategy in (("plain", lambda: "auto"),
                           ("split", lambda: SomatizeStrategy(place={"backbone": "worker"}))):
        pl.seed_everything(0)
        s = strategy()
        _, losses, weights = fit(Finetuned(), s, digits(), max_epochs=3,
                                 callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
        got[name] = (losses, weights)
    torch.save({**got, "vals": (None, None), "ran": s.where(), "pid": os.getpid()},
               out)


def batchnorm(out):
    both(Normed, {"encoder": "worker"}, out, digits(), max_epochs=2, limit_val_batches=2)


def many_calls(out):
    both(Many, {"encoder": "worker"}, out, digits(), max_epochs=2)


def siamese_bf16(out):
    """The siamese module (two calls per step) under bf16-mixed autocast."""
    both(Siamese, {"encoder": "worker"}, out, digits(), max_epochs=1, precision="bf16-mixed")


def traced(out):
    """Split fits with trace=: the drop-in autoencoder under Lightning (with a CSV logger
    for the somatize/* metrics), and the seeds' graph under somatize's Trainer."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from somatize import Graph
    from somatize.torch import Split, Trainer, parameters

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import Body, Head, batches

    pl.seed_everything(0)
    strategy = SomatizeStrategy(place={"encoder": "worker"}, trace=out + ".lightning.json")
    logs = os.path.join(os.path.dirname(out), "logs")
    trainer, _, _ = fit(PlainAutoEncoder(), strategy, digits(), max_epochs=2,
                        limit_val_batches=0, logger=CSVLogger(logs, name="csv"))
    with open(next(os.path.join(r, f) for r, _, fs in os.walk(logs) for f in fs
                   if f == "metrics.csv")) as f:
        metrics = [r for r in csv.DictReader(f) if r.get("somatize/bytes_sent")]
    g = Graph.somatize(Body(seed=None).at("gpu") >> Head(seed=None))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    with Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                 trains=trains, trace=out + ".trainer.json") as t:
        t.fit(batches(5), progress=False)
    torch.save({"lightning_steps": trainer.global_step, "trainer_steps": 5,
                "pid": os.getpid(), "metrics": metrics}, out)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
