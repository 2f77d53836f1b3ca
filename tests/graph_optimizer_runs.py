"""Runs of a real lightning.Trainer, plain and with SomatizeStrategy, for the graph route's
optimizers over there: a GraphModule whose encoder node is placed with ``.at("worker")``
and trained there by mirrors of the Lightning optimizer that holds it (no ``trains=``).
The fit, the data, the losses and the worker kept across fits are
tests/placed_optimizer_runs.py's. tests/test_graph_optimizers.py calls them.

    python tests/graph_optimizer_runs.py cases OUT.pt
"""

import os
import sys

import lightning.pytorch as pl
import torch
from oracle import weights
from placed_optimizer_runs import data, fit, keep_worker
from torch import nn
from torch.nn import functional as F

from somatize import Done, Graph, Node, Opaque
from somatize.lightning import SomatizeStrategy
from somatize.torch import GraphModule


class Encoder(Node):
    """64 -> 32 -> 16, placed: four parameter tensors."""

    def __init__(self):
        self.body = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16))

    def forward(self, x, ctx):
        return Done(Opaque(self.body(x)))

    def parameters(self):
        return list(self.body.parameters())


class Decoder(Node):
    """16 -> 64, here."""

    def __init__(self):
        self.lin = nn.Linear(16, 64)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


class KeepsClip(torch.optim.SGD):
    """Keeps a setting of its own beside defaults: a rebuild over there would miss it."""

    def __init__(self, params, lr=0.1, clip=1.0):
        super().__init__(params, lr=lr)
        self.clip = clip


def warmup(step):
    return min(1.0, (step + 1) / 3)


def adamw(enc, dec):
    return torch.optim.AdamW([{"params": enc, "lr": 1e-2}, {"params": dec, "lr": 3e-3}],
                             weight_decay=0.05)


def sgd(enc, dec):
    # the encoder's group with its own lr and momentum
    return torch.optim.SGD([{"params": enc, "lr": 5e-2, "momentum": 0.5},
                            {"params": dec, "lr": 3e-2}], momentum=0.9, weight_decay=1e-4)


# per case: the optimizer over two param groups (the encoder's, the decoder's), each with
# hyper-parameters of its own, and a per-step scheduler (or none)
CASES = {
    # AdamW: its constructor takes decoupled_weight_decay, which its defaults do not say
    "AdamW": lambda enc, dec: (adamw(enc, dec), None),
    "AdamW StepLR": lambda enc, dec: (
        adamw(enc, dec), lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)),
    "SGD groups": lambda enc, dec: (sgd(enc, dec), None),
    "SGD warmup": lambda enc, dec: (
        sgd(enc, dec), lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup)),
    "KeepsClip": lambda enc, dec: (KeepsClip([*enc, *dec], clip=0.5), None),
}


class GraphNet(pl.LightningModule):
    """``Encoder().at("worker") >> Decoder()`` in a GraphModule, an autoencoder's loss."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.net = GraphModule(Graph.somatize(Encoder().at("worker") >> Decoder()))

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.net(x), x)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        nodes = self.net.nodes
        opt, scheduler = CASES[self.case](list(nodes["encoder"].parameters()),
                                          list(nodes["decoder"].parameters()))
        if scheduler is None:
            return opt
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}


class Held(pl.Callback):
    """How many tensors Lightning's optimizers hold, and which processes ran the encoder."""

    def on_train_end(self, trainer, pl_module):
        self.held = sum(len(g["params"]) for o in trainer.optimizers for g in o.param_groups)
        where = trainer.strategy.where() if hasattr(trainer.strategy, "where") else {}
        self.ran = sorted(where.get("net.encoder", {}))


class SaveAtFirstEpochEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` at the end of the first epoch, during fit."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def strategies():
    return (("plain", lambda: "auto"), ("split", SomatizeStrategy))


def trained(where):
    """Per case, plain and split: four steps' losses, the weights, a checkpoint written
    after fit (optimizer states, schedulers), how many tensors Lightning's optimizer held
    and which processes ran the encoder; or what the fit raised."""
    got = {}
    for case in CASES:
        if case == "KeepsClip":
            continue  # refused()'s
        got[case] = {}
        for kind, strategy in strategies():
            pl.seed_everything(0)
            model, held = GraphNet(case), Held()
            try:
                trainer, losses = fit(model, strategy(), max_steps=4, callbacks=[held])
            except Exception as e:  # noqa: BLE001 (what the run said, for the test to show)
                got[case][kind] = {"said": f"{type(e).__name__}: {e}"}
                continue
            path = os.path.join(where, f"{case}-{kind}.ckpt")
            trainer.save_checkpoint(path)
            ckpt = torch.load(path, weights_only=False)
            got[case][kind] = {"said": "", "losses": losses, "weights": weights(model),
                               "optimizer": ckpt["optimizer_states"],
                               "schedulers": ckpt.get("lr_schedulers"), "held": held.held,
                               "ran": held.ran}
    return got


def resumed(where):
    """SGD's case with groups of their own and a warmup, plain and split: two epochs,
    checkpointed by trainer.save_checkpoint at the end of the first (during fit); then a
    fresh model resumed from that checkpoint for the second epoch, under the same
    strategy, and plainly from the split one."""
    got = {"said": ""}
    for kind, strategy in strategies():
        path = os.path.join(where, f"first-epoch-{kind}.ckpt")
        pl.seed_everything(0)
        model = GraphNet("SGD warmup")
        _, losses = fit(model, strategy(), max_epochs=2,
                        callbacks=[SaveAtFirstEpochEnd(path)])
        ckpt = torch.load(path, weights_only=False)
        pl.seed_everything(1)
        again = GraphNet("SGD warmup")
        _, more = fit(again, strategy(), ckpt=path, max_epochs=2)
        got[kind] = {"losses": losses, "weights": weights(model),
                     "ckpt": {k: ckpt[k] for k in ("optimizer_states", "lr_schedulers",
                                                   "state_dict")},
                     "resumed": (more, weights(again))}
    pl.seed_everything(1)
    crossed = GraphNet("SGD warmup")
    _, more = fit(crossed, "auto", ckpt=os.path.join(where, "first-epoch-split.ckpt"),
                  max_epochs=2)
    got["plain from split"] = (more, weights(crossed))
    return got


def refused():
    """An optimizer that cannot be rebuilt over there as it is here: what the fit said, and
    how many steps it took first."""
    model = GraphNet("KeepsClip")
    try:
        fit(model, SomatizeStrategy(), max_steps=2)
        return "fitted", None
    except Exception as e:  # noqa: BLE001 (what the run said, for the test to show)
        return f"{type(e).__name__}: {e}", model.global_step


def cases(out):
    """Every case in one process (one worker kept across fits), saved in ``out``."""
    keep_worker()
    where = os.path.dirname(out)
    assert len(data()) == 4  # four batches an epoch
    got = {"refused": refused(), "trained": trained(where)}
    try:
        got["resumed"] = resumed(where)
    except Exception as e:  # noqa: BLE001 (what the run said, for the test to show)
        got["resumed"] = {"said": f"{type(e).__name__}: {e}"}
    torch.save(got, out)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
