"""Runs of a real lightning.Trainer that start RPC, each in its own process (RPC is
started once per process); tests/test_lightning_split.py calls them and reads what
they save.

    python tests/lightning_runs.py oracle OUT.pt 2     # plain then split, accumulate 2
"""

import logging
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from oracle import Losses, weights

from examples.digits import DigitsData
from examples.digits_graph import Body, DigitsGraphModel
from somatize import Done, Graph, Node, Opaque
from somatize.lightning import SomatizeStrategy
from somatize.remote import Worker
from somatize.torch import GraphModule


def fit(strategy, *, steps=10, epochs=None, accumulate=1, ckpt_dir=None, ckpt_path=None,
        callbacks=(), model=None):
    pl.seed_everything(0)
    model = model or DigitsGraphModel(lr=0.5, momentum=0.9)
    losses = Losses()
    trainer = pl.Trainer(
        max_steps=steps if epochs is None else -1, max_epochs=epochs, strategy=strategy,
        accumulate_grad_batches=accumulate, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=1, callbacks=[losses, *callbacks],
        enable_checkpointing=ckpt_dir is not None, default_root_dir=ckpt_dir,
    )
    trainer.fit(model, DigitsData(batch_size=32, limit=160), ckpt_path=ckpt_path)
    return trainer, model, losses.losses





class Where(pl.Callback):
    """Where the body trained: did its weights in this process move during a training
    step (the strategy brings them here at epoch ends), which process answers for the
    worker, and how many tensors Lightning's optimizers hold."""

    def on_train_start(self, trainer, pl_module):
        self.moved_here = False
        self.held = sum(len(g["params"]) for o in trainer.optimizers for g in o.param_groups)
        self.body_pids = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = pl_module.net.nodes["body"].lin.weight.detach().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.moved_here |= not torch.equal(pl_module.net.nodes["body"].lin.weight, self.start)
        if hasattr(trainer.strategy, "where"):  # the processes that ran the body, by count
            self.body_pids = sorted(trainer.strategy.where()["net.body"])

    def evidence(self):
        return {"moved_here": self.moved_here, "held": self.held,
                "body_pids": self.body_pids, "pid": os.getpid()}


def oracle(out, accumulate):
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("somatize").addHandler(handler)
    logging.getLogger("somatize").setLevel(logging.INFO)
    plain_where, split_where = Where(), Where()
    _, plain, plain_losses = fit("auto", accumulate=int(accumulate), callbacks=[plain_where])
    _, split, split_losses = fit(SomatizeStrategy(), accumulate=int(accumulate),
                                 callbacks=[split_where])
    torch.save({"plain": (plain_losses, weights(plain)),
                "split": (split_losses, weights(split)),
                "where": {"plain": plain_where.evidence(), "split": split_where.evidence()},
                "said": said}, out)


def resume(out, part, stop="epoch"):
    """``whole``: two epochs; ``first``: one epoch (``stop="epoch"``) or seven steps, two
    into the second epoch (``stop="mid"``), checkpointed; ``rest``: resumed to two epochs."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_dir = os.path.dirname(out)
    if part == "whole":
        _, m, losses = fit(SomatizeStrategy(), epochs=2)
    elif part == "first" and stop == "epoch":
        _, m, losses = fit(SomatizeStrategy(), epochs=1, ckpt_dir=ckpt_dir)
    elif part == "first":  # five batches an epoch: step 7 is mid-epoch
        mid = ModelCheckpoint(dirpath=ckpt_dir, filename="mid", every_n_train_steps=7)
        _, m, losses = fit(SomatizeStrategy(), steps=7, ckpt_dir=ckpt_dir, callbacks=[mid])
    else:
        ckpt = next(os.path.join(r, f) for r, _, fs in os.walk(ckpt_dir) for f in fs
                    if f.endswith(".ckpt") and (stop == "epoch" or f == "mid.ckpt"))
        _, m, losses = fit(SomatizeStrategy(), epochs=2, ckpt_path=ckpt)
    torch.save((losses, weights(m)), out)


class Logits(Node):
    """No weights: the body's features are the logits."""

    def forward(self, x, ctx):
        return Done(Opaque(x))


class AllRemote(DigitsGraphModel):
    """A model whose only trainable weights are on the worker."""

    def __init__(self):
        super().__init__(lr=0.5)
        self.net = GraphModule(Graph.somatize(Body(hidden=10).at("worker") >> Logits()))


def all_remote(out):
    trainer, m, losses = fit(SomatizeStrategy(), steps=10, model=AllRemote())
    before = weights(m)
    trainer.validate(m, DigitsData(batch_size=32), verbose=False)
    trainer.test(m, DigitsData(batch_size=32), verbose=False)
    preds = trainer.predict(m, DigitsData(batch_size=32))
    pl.seed_everything(0)
    fresh = weights(AllRemote())
    torch.save({"losses": losses, "trained": before, "fresh": fresh, "after": weights(m),
                "predicted": sum(len(p) for p in preds)}, out)


class Balky(Body):
    """The body, raising a ValueError on its third training batch, where it runs."""

    seen = 0

    def forward(self, x, ctx):
        if ctx.training:
            self.seen += 1
            if self.seen == 3:
                raise ValueError("the third batch")
        return super().forward(x, ctx)


def raises(out):
    """A node's ValueError on the worker, mid-fit: what trainer.fit raised."""
    from examples.digits_graph import Head

    model = DigitsGraphModel(lr=0.5)
    model.net = GraphModule(Graph.somatize(Balky().named("body").at("worker") >> Head()))
    try:
        fit(SomatizeStrategy(), steps=5, model=model)
        got = {"type": None}
    except Exception as e:  # noqa: BLE001 (what it raised, for the test to read)
        got = {"type": type(e).__name__, "message": str(e),
               "cause": (type(e.__cause__).__name__, str(e.__cause__))}
    torch.save(got, out)


class Kill(pl.Callback):
    """Kill the worker process at the third batch: the one the strategy says ran the body."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            from remote_run import no_worker_left

            there = [p for p in trainer.strategy.where()["net.body"] if p != os.getpid()]
            assert len(there) == 1, trainer.strategy.where()
            os.kill(there[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not no_worker_left(there) and time.monotonic() < deadline:
                time.sleep(0.02)


def kill(out):
    try:
        fit(SomatizeStrategy(workers={"worker": Worker.embedded(timeout=20)}), steps=10,
            callbacks=[Kill()])
    except Exception as e:
        with open(out, "w") as f:
            f.write(f"{type(e).__name__}: {e}")


def lost_checkpoint(out):
    """The worker killed mid-fit with OnExceptionCheckpoint in the callbacks, then a
    trainer.save_checkpoint() after: what each said, and which files were written."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    ckpt_dir = os.path.join(os.path.dirname(out), "ckpts")
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=10, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1,
                         default_root_dir=os.path.join(os.path.dirname(out), "root"),
                         strategy=SomatizeStrategy(workers={"worker": Worker.embedded(
                             timeout=20)}),
                         callbacks=[Kill(), OnExceptionCheckpoint(ckpt_dir)])
    said = []
    try:
        trainer.fit(DigitsGraphModel(lr=0.5), DigitsData(batch_size=32, limit=160))
    except Exception as e:
        said.append(f"{type(e).__name__}: {e}")
    try:
        trainer.save_checkpoint(os.path.join(ckpt_dir, "later.ckpt"))
    except Exception as e:
        said.append(f"{type(e).__name__}: {e}")
    written = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    torch.save({"said": said, "written": written}, out)


def standing(out, address):
    """One process: a graph through somatize.remote, then Lightning on a standing worker."""
    from examples.digits_graph import Head

    x = torch.rand(4, 64)
    with Graph.somatize(Body().at("worker") >> Head()) as g:
        g.forward(x)  # an embedded worker, through somatize.remote
    _, plain, plain_losses = fit("auto")
    _, split, split_losses = fit(SomatizeStrategy(workers={"worker": Worker.at(address)}))
    torch.save({"plain": (plain_losses, weights(plain)),
                "split": (split_losses, weights(split))}, out)


class Counted(Body):
    """The body, counting its runs where it runs."""

    runs = 0

    def forward(self, x, ctx):
        self.runs += 1
        return super().forward(x, ctx)


class Encoded(DigitsGraphModel):
    """A frozen, cached body on the worker; the head trains here."""

    def __init__(self):
        super().__init__(lr=0.5)
        from examples.digits_graph import Head

        self.net = GraphModule(Graph.somatize(
            Counted().named("body").at("worker").frozen().cached() >> Head()))


class RunsOverThere(pl.Callback):
    """How many times the body ran on the worker, at the end of each epoch (as the
    strategy's where() says: a value found kept over there is not a run)."""

    def __init__(self):
        self.counts = []

    def on_train_epoch_end(self, trainer, pl_module):
        ran = trainer.strategy.where()["net.body"]
        self.counts.append(sum(n for pid, n in ran.items() if pid != os.getpid()))


def worker_keeps(out, store, how="workers"):
    """The body kept by its worker in ``store``: given as ``Worker.embedded(store=...)``,
    or (``how="strategy"``) as ``SomatizeStrategy(store=...)``."""
    from somatize.lightning import SomatizeCache

    counted = RunsOverThere()
    strategy = SomatizeStrategy(workers={"worker": Worker.embedded(store=store)}) \
        if how == "workers" else SomatizeStrategy(store=store)
    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=2, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1, enable_checkpointing=False,
                         callbacks=[SomatizeCache(os.path.join(os.path.dirname(out), "here")),
                                    counted])
    trainer.fit(Encoded(), DigitsData(batch_size=32, limit=64, shuffle=False))
    torch.save({"counts": counted.counts}, out)


def hashes(out, store):
    """How many hashes a split fit computes with a store attached: nothing cached, then
    the body frozen and cached (the control)."""
    import somatize._keys as keys
    from somatize.lightning import SomatizeCache

    real, counts = keys.blake3, []

    def counted(*a, **kw):
        counts[-1] += 1
        return real(*a, **kw)

    keys.blake3 = counted
    for cached in (False, True):
        counts.append(0)
        model = DigitsGraphModel(lr=0.5, frozen=cached, cached=cached)
        fit(SomatizeStrategy(), steps=6, model=model,
            callbacks=[SomatizeCache(os.path.join(store, str(cached)))])
    torch.save(counts, out)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
