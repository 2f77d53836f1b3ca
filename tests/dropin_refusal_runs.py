"""Drop-in runs of what the strategy refuses or says: the stale copy here during fit, the
log about each placed module, an optimizer chosen over there and a scheduler it cannot
follow. Run through tests/dropin_runs.py, or alone:

    python tests/dropin_refusal_runs.py stale OUT.pt
"""

import sys

import lightning.pytorch as pl
import torch
from dropin_models import AutoEncoder, PlainAutoEncoder, digits, fit

from somatize.lightning import SomatizeStrategy


class ReadsEncoder(pl.Callback):
    """A callback that calls the placed module's child here during fit."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.encoder[0](batch[0])


class ReadsAtEpochEnd(pl.Callback):
    """What a callback sees of the encoder's weights at each epoch end."""

    def __init__(self):
        self.seen = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append(pl_module.encoder[0].weight.detach().clone())


def stale(out):
    from somatize import Refused

    said = ""
    try:
        fit(AutoEncoder(), SomatizeStrategy(place={"encoder": "worker"}), digits(),
            max_epochs=1, callbacks=[ReadsEncoder()])
    except Refused as e:
        said = str(e)
    seen = {}
    for name, strategy in (("plain", "auto"),
                           ("split", SomatizeStrategy(place={"encoder": "worker"}))):
        pl.seed_everything(0)
        reads = ReadsAtEpochEnd()
        fit(AutoEncoder(), strategy, digits(), max_epochs=2, limit_val_batches=0,
            callbacks=[reads])
        seen[name] = reads.seen
    torch.save({"said": said, "seen": seen}, out)


class FrozenEncoder(AutoEncoder):
    """The autoencoder with its encoder frozen: only the decoder trains."""

    def __init__(self):
        super().__init__()
        self.encoder.requires_grad_(False)


class HooksDuringFit(pl.Callback):
    """Puts a forward hook on a child of the placed encoder once fit has started."""

    def on_train_start(self, trainer, pl_module):
        pl_module.encoder[0].register_forward_hook(lambda *a: None)


def said(out):
    """What the strategy logs about each placed module: a trained one and a frozen one."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("somatize")
    logger.addHandler(keep := Keep())
    logger.setLevel(logging.INFO)
    got = {}
    for name, make in (("trained", AutoEncoder), ("frozen", FrozenEncoder)):
        lines.clear()
        fit(make(), SomatizeStrategy(place={"encoder": "worker"}), digits(), max_steps=2,
            limit_val_batches=0)
        got[name] = [line for line in lines if line.startswith("module 'encoder' (")]
    lines.clear()
    fit(AutoEncoder(), SomatizeStrategy(place={"encoder": "worker"}), digits(), max_steps=3,
        limit_val_batches=0, callbacks=[HooksDuringFit()])
    got["hooked"] = [line for line in lines if "hook" in line]
    logger.removeHandler(keep)
    torch.save(got, out)


class NoSchedule(PlainAutoEncoder):
    def configure_optimizers(self):
        return torch.optim.Adam([{"params": self.encoder.parameters(), "lr": 3e-3},
                                 {"params": self.decoder.parameters(), "lr": 1e-3}])


def chosen(out):
    """trains= on the drop-in route: the encoder trained over there by the optimizer the
    user chose (Adam at 3e-3), against plain Lightning's Adam with that group's rate; and a
    scheduler driving an optimizer that also holds the encoder: refused."""
    from somatize import Refused
    from somatize.torch import Split

    pl.seed_everything(0)
    _, plain_losses, plain = fit(NoSchedule(), "auto", digits(), max_epochs=1)
    pl.seed_everything(0)
    strategy = SomatizeStrategy(place={"encoder": "worker"},
                                trains={"encoder": Split(torch.optim.Adam, lr=3e-3)})
    _, split_losses, split = fit(NoSchedule(), strategy, digits(), max_epochs=1)
    said = ""
    try:
        fit(PlainAutoEncoder(), SomatizeStrategy(
            place={"encoder": "worker"}, trains={"encoder": Split(torch.optim.SGD, lr=0.1)}),
            digits(), max_epochs=1)
    except Refused as e:
        said = str(e)
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "said": said}, out)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
