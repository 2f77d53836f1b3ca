"""Runs of a real lightning.Trainer that start RPC, each in its own process (RPC is
started once per process); tests/test_lightning_split.py calls them and reads what
they save.

    python tests/lightning_runs.py oracle OUT.pt 2     # plain then split, accumulate 2
"""

import os
import sys

import lightning.pytorch as pl
import torch

from somatize import Done, Graph, Node, Opaque
from somatize.lightning import SomatizeStrategy
from somatize.lightning.digits import Body, DigitsData, DigitsModel
from somatize.remote import Worker
from somatize.torch import GraphModule


class Losses(pl.Callback):
    """Every training step's loss, as a float."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def fit(strategy, *, steps=10, epochs=None, accumulate=1, ckpt_dir=None, ckpt_path=None,
        callbacks=(), model=None):
    pl.seed_everything(0)
    model = model or DigitsModel(lr=0.5, momentum=0.9)
    losses = Losses()
    trainer = pl.Trainer(
        max_steps=steps if epochs is None else -1, max_epochs=epochs, strategy=strategy,
        accumulate_grad_batches=accumulate, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=1, callbacks=[losses, *callbacks],
        enable_checkpointing=ckpt_dir is not None, default_root_dir=ckpt_dir,
    )
    trainer.fit(model, DigitsData(batch_size=32, limit=160), ckpt_path=ckpt_path)
    return trainer, model, losses.losses


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def oracle(out, accumulate):
    _, plain, plain_losses = fit("auto", accumulate=int(accumulate))
    _, split, split_losses = fit(SomatizeStrategy(), accumulate=int(accumulate))
    torch.save({"plain": (plain_losses, weights(plain)),
                "split": (split_losses, weights(split))}, out)


def resume(out, part):
    """``whole``: two epochs; ``first``: one, checkpointed; ``rest``: resumed to two."""
    ckpt_dir = os.path.dirname(out)
    if part == "whole":
        _, m, losses = fit(SomatizeStrategy(), epochs=2)
    elif part == "first":
        _, m, losses = fit(SomatizeStrategy(), epochs=1, ckpt_dir=ckpt_dir)
    else:
        ckpt = next(os.path.join(r, f) for r, _, fs in os.walk(ckpt_dir) for f in fs
                    if f.endswith(".ckpt"))
        _, m, losses = fit(SomatizeStrategy(), epochs=2, ckpt_path=ckpt)
    torch.save((losses, weights(m)), out)


class Logits(Node):
    """No weights: the body's features are the logits."""

    def forward(self, x, ctx):
        return Done(Opaque(x))


class AllRemote(DigitsModel):
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


class Kill(pl.Callback):
    """Kill the worker process at the third batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            proc = trainer.strategy.runs["net"].runtime.peers["worker"].proc
            proc.kill()
            proc.wait(timeout=30)


def kill(out):
    try:
        fit(SomatizeStrategy(workers={"worker": Worker.embedded(timeout=20)}), steps=10,
            callbacks=[Kill()])
    except Exception as e:
        with open(out, "w") as f:
            f.write(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    {"oracle": oracle, "resume": resume, "all_remote": all_remote, "kill": kill}[sys.argv[1]](
        *sys.argv[2:])
