"""Runs of a real lightning.Trainer on unmodified LightningModules, plain and with
SomatizeStrategy(place=...), each in its own process (RPC starts once per process);
tests/test_dropin.py calls them and reads what they save.

    python tests/dropin_runs.py transformer OUT.pt
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch.utils.data as tud
from lightning.pytorch.demos.transformer import LightningTransformer
from torch import nn
from torch.nn import functional as F

from somatize.lightning import SomatizeStrategy


class Tokens(tud.Dataset):
    """Synthetic token sequences (nothing downloaded)."""

    def __init__(self, n=48, seq=12, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i, :-1], self.x[i, 1:]


class DemoTransformer(LightningTransformer):
    """Lightning's demo Transformer (dropout 0.2), on synthetic tokens."""

    def prepare_data(self):
        pass  # the demo downloads WikiText-2 here

    def train_dataloader(self):
        return tud.DataLoader(Tokens(), batch_size=8)


class AutoEncoder(pl.LightningModule):
    """The classic Lightning autoencoder: dropout in the encoder, Adam with two param
    groups at different rates, a per-step StepLR."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2),
                                     nn.Linear(32, 8))
        self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64))

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, i):
        x = batch[0]
        self.log("val", F.mse_loss(self.decoder(self.encoder(x)), x))

    def configure_optimizers(self):
        opt = torch.optim.Adam([{"params": self.encoder.parameters(), "lr": 3e-3},
                                {"params": self.decoder.parameters(), "lr": 1e-3}])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def digits(n=96):
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:n], dtype=torch.float32) / 16.0
    return tud.DataLoader(tud.TensorDataset(x), batch_size=16)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization: the encoder's optimizer steps every batch, the decoder's every
    other batch; both see the encoder."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.Tanh())
        self.decoder = nn.Linear(16, 64)

    def training_step(self, batch, i):
        x = batch[0]
        opt_e, opt_d = self.optimizers()
        loss = F.mse_loss(self.decoder(self.encoder(x)), x)
        opt_e.zero_grad()
        if i % 2 == 0:
            opt_d.zero_grad()
        self.manual_backward(loss)
        opt_e.step()
        if i % 2 == 1:
            opt_d.step()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return (torch.optim.SGD(self.encoder.parameters(), lr=0.1, momentum=0.9),
                torch.optim.SGD([*self.encoder.parameters(), *self.decoder.parameters()],
                                lr=0.05))


class Parts(nn.Module):
    """Answers a dict of tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, x, *, scale=1.0):
        h = self.lin(x)
        return {"mean": h * scale, "gate": torch.sigmoid(h), "n": x.shape[0]}


class Siamese(pl.LightningModule):
    """A dict-answering encoder called twice per step (a siamese loss)."""

    def __init__(self):
        super().__init__()
        self.encoder = Parts()
        self.head = nn.Linear(8, 8)

    def training_step(self, batch, i):
        x = batch[0]
        a, b = self.encoder(x), self.encoder(x.flip(0), scale=0.5)
        loss = F.mse_loss(self.head(a["mean"] * a["gate"]), b["mean"]) + 0 * a["n"]
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        got = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.callback_metrics.get("loss", got)) if got is None
                           else got.item())


def fit(model, strategy, data=None, **kw):
    losses = Losses()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=strategy, callbacks=[losses, *kw.pop("callbacks", [])],
                         **{"enable_checkpointing": False, **kw})
    trainer.fit(model, data)
    return trainer, losses.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def both(make, place, out, data=None, **kw):
    pl.seed_everything(0)
    _, plain_losses, plain = fit(make(), "auto", data, **kw)
    pl.seed_everything(0)
    strategy = SomatizeStrategy(place=place)
    _, split_losses, split = fit(make(), strategy, data, **kw)
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "ran": strategy.where().get("", {}), "pid": os.getpid()}, out)


def transformer(out):
    both(DemoTransformer, {"model.transformer": "worker"}, out, max_steps=5)


def autoencoder(out):
    both(AutoEncoder, {"encoder": "worker"}, out, digits(), max_epochs=2,
         accumulate_grad_batches=2, limit_val_batches=1)


def manual(out):
    both(TwoOptimizers, {"encoder": "worker"}, out, digits(), max_epochs=1)


def siamese(out):
    both(Siamese, {"encoder": "worker"}, out, digits(), max_epochs=1)


def resume(out, first, then):
    """Epoch 1 under ``first`` (checkpointed), then resumed under ``then`` to epoch 2."""
    ckpt_dir = os.path.join(os.path.dirname(out), f"{first}-{then}")
    strategies = {"plain": lambda: "auto",
                  "split": lambda: SomatizeStrategy(place={"encoder": "worker"})}
    pl.seed_everything(0)
    fit(AutoEncoder(), strategies[first](), digits(), max_epochs=1, limit_val_batches=1,
        accumulate_grad_batches=2, enable_checkpointing=True, default_root_dir=ckpt_dir)
    ckpt = next(os.path.join(r, f) for r, _, fs in os.walk(ckpt_dir) for f in fs
                if f.endswith(".ckpt"))
    saved = torch.load(ckpt, weights_only=False)
    pl.seed_everything(1)
    model = AutoEncoder()
    losses = Losses()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=strategies[then](), callbacks=[losses], max_epochs=2,
                         limit_val_batches=1, accumulate_grad_batches=2,
                         enable_checkpointing=False)
    trainer.fit(model, digits(), ckpt_path=ckpt)
    torch.save({"losses": losses.losses, "ckpt": {"state_dict": saved["state_dict"],
                                                   "optimizer_states": saved["optimizer_states"],
                                                   "lr_schedulers": saved["lr_schedulers"]},
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               out)


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


def resumes(out):
    """The three resumes the test compares, in one process: plain from plain (the
    oracle: Lightning does not checkpoint the RNG), split from plain, plain from split."""
    got = {}
    for first, then in (("plain", "plain"), ("plain", "split"), ("split", "plain")):
        path = os.path.join(os.path.dirname(out), f"{first}-{then}.pt")
        resume(path, first, then)
        got[f"{first}-{then}"] = torch.load(path, weights_only=False)
    torch.save(got, out)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
