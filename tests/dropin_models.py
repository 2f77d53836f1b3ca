"""The unmodified LightningModules the drop-in runs train (tests/dropin_*_runs.py), and
their plumbing: ``fit`` (a real lightning.Trainer, its losses kept) and ``both`` (plain
Lightning, then SomatizeStrategy(place=...), saved side by side)."""

import os

import lightning.pytorch as pl
import oracle
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


class GAN(pl.LightningModule):
    """Lightning's GAN recipe: manual optimization, ``toggle_optimizer`` around each
    player's step (which sets requires_grad of the other's parameters), the generator's
    output fed to the discriminator's loss without a detach."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64))
        self.discriminator = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, i):
        x = batch[0]
        real, fake = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
        opt_g, opt_d = self.optimizers()
        z = torch.randn(x.shape[0], 8)
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), real)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)  # the generator's parameters stop asking for grads
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(x), real)
                  + F.binary_cross_entropy_with_logits(
                      self.discriminator(self.generator(z)), fake)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log("loss", g_loss + d_loss)
        return (g_loss + d_loss).detach()

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)))


class Finetuned(pl.LightningModule):
    """A backbone frozen at the start and unfrozen at epoch 1 by Lightning's
    ``BackboneFinetuning``, which adds its parameters to the optimizer as a new group."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 64)

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.head(self.backbone(x)), x)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-3)


class Normed(AutoEncoder):
    """The autoencoder with BatchNorm on both sides of the cut, validated each epoch
    (running statistics used), SGD with momentum."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Linear(32, 8))
        self.decoder = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Linear(32, 64))
        self.vals: list[float] = []

    def validation_step(self, batch, i):
        x = batch[0]
        self.vals.append(F.mse_loss(self.decoder(self.encoder(x)), x).item())

    def val_dataloader(self):
        return digits(32)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Many(pl.LightningModule):
    """One encoder called six times per step, none of its inputs asking for a gradient:
    six backwards in flight over there at once, whose gradients must add up in the order
    one piece adds them."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 10)

    def training_step(self, batch, i):
        x = batch[0]
        h = sum(self.encoder(x * (k + 1) / 6) * (k + 1) for k in range(6)) / 21
        loss = F.mse_loss(self.head(h), x[:, :10])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class PlainAutoEncoder(AutoEncoder):
    """The autoencoder without dropout (the precision and clipping runs)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


def fit(model, strategy, data=None, **kw):
    trainer, losses = oracle.fit(model, strategy, data, **kw)
    return trainer, losses, oracle.weights(model)


def both(make, place, out, data=None, **kw):
    pl.seed_everything(0)
    _, plain_losses, plain = fit(model := make(), "auto", data, **kw)
    plain_vals = getattr(model, "vals", None)
    pl.seed_everything(0)
    strategy = SomatizeStrategy(place=place)
    _, split_losses, split = fit(model := make(), strategy, data, **kw)
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "vals": (plain_vals, getattr(model, "vals", None)),
                "ran": strategy.where(), "pid": os.getpid()}, out)
