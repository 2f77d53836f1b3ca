"""Runs of a real lightning.Trainer, plain and with SomatizeStrategy(place=...), for the
optimizers over there: every torch.optim optimizer with param groups and a scheduler,
one written in this script, ones that cannot be rebuilt, a checkpoint written after fit
returns, and Ctrl-C at any moment. tests/test_placed_optimizers.py calls them.

    python tests/placed_optimizer_runs.py optimizers OUT.pt SGD AdamW
"""

import os
import sys
import time

import lightning.pytorch as pl
import oracle
import torch
import torch.utils.data as tud
from oracle import weights
from torch import nn
from torch.nn import functional as F

from somatize.lightning import SomatizeStrategy

# per optimizer: constructor arguments away from its defaults, so that each is seen
SETTINGS = {
    "SGD": {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
    "Adam": {"betas": (0.8, 0.99), "weight_decay": 1e-4, "amsgrad": True},
    "AdamW": {"weight_decay": 0.05},
    "Adamax": {"weight_decay": 1e-3},
    "NAdam": {"momentum_decay": 3e-3, "decoupled_weight_decay": True, "weight_decay": 0.01},
    "RAdam": {"decoupled_weight_decay": True, "weight_decay": 0.01},
    "Adagrad": {"lr_decay": 0.01},
    "Adadelta": {"rho": 0.8},
    "RMSprop": {"momentum": 0.5, "centered": True},
    "Rprop": {"etas": (0.4, 1.3)},
    "ASGD": {"t0": 2.0},
    "Adafactor": {"beta2_decay": -0.7},
    "Muon": {"momentum": 0.9},
    "SignSGD": {"decay": 0.5},
}


class SignSGD(torch.optim.Optimizer):
    """An optimizer written in a user's script, following torch.optim's conventions
    (every constructor argument kept in defaults)."""

    def __init__(self, params, lr=1e-2, decay=0.0):
        super().__init__(params, {"lr": lr, "decay": decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["avg"] = st.get("avg", torch.zeros_like(p)) * group["decay"] + p.grad
                p.add_(st["avg"].sign(), alpha=-group["lr"])
        return loss


class NeedsScale(torch.optim.SGD):
    """Its constructor needs an argument it does not keep in defaults."""

    def __init__(self, params, scale, lr=0.1):
        self.scale = scale
        super().__init__(params, lr=lr)


class KeepsClip(torch.optim.SGD):
    """Keeps a setting of its own beside defaults: a rebuild would miss it."""

    def __init__(self, params, lr=0.1, clip=1.0):
        super().__init__(params, lr=lr)
        self.clip = clip


def keep_worker():
    """Hold the embedded worker 'worker' across this process's fits (one start, not one
    per fit): each fit's run still opens and closes its own session on it."""
    from somatize.remote import Worker
    from somatize.remote._group import group

    p = group().peer("worker", Worker.embedded())
    group().wait_joined([p])


def optimizer_class(name):
    return getattr(torch.optim, name, None) or globals()[name]


class Net(pl.LightningModule):
    """An encoder (placed) and a decoder, in two param groups at different rates, a
    per-step StepLR. Muon takes matrices only: no biases for it."""

    def __init__(self, name, **kw):
        super().__init__()
        bias = name != "Muon"
        self.name, self.kw = name, kw
        self.encoder = nn.Sequential(nn.Linear(64, 32, bias=bias), nn.Tanh(),
                                     nn.Linear(32, 16, bias=bias))
        self.decoder = nn.Linear(16, 64, bias=bias)

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = optimizer_class(self.name)(
            [{"params": self.encoder.parameters(), "lr": 1e-2},
             {"params": self.decoder.parameters(), "lr": 3e-3}], **self.kw)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Body(pl.LightningModule):
    """A 4-layer body (placed) and a head, Adam: 8 parameter tensors, 6 placed."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                  nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 64)

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.head(self.body(x)), x)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, i):
        self.log("val", F.mse_loss(self.head(self.body(batch[0])), batch[0]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tud.DataLoader(tud.TensorDataset(torch.rand(n, 64, generator=g)), batch_size=16)


def fit(model, strategy, ckpt=None, callbacks=(), **kw):
    return oracle.fit(model, strategy, data(), ckpt_path=ckpt, callbacks=callbacks, **kw)





def optimizers(out, *names):
    """Each optimizer, plain and placed: losses, weights, and the optimizer state of a
    checkpoint written after fit returns."""
    keep_worker()
    got = {}
    where = os.path.dirname(out)
    for name in names:
        got[name] = {}
        for kind, strategy in (("plain", lambda: "auto"),
                               ("split", lambda: SomatizeStrategy(place={"encoder": "worker"}))):
            pl.seed_everything(0)
            model = Net(name, **SETTINGS[name])
            trainer, losses = fit(model, strategy(), max_steps=4)
            path = os.path.join(where, f"{name}-{kind}.ckpt")
            trainer.save_checkpoint(path)
            ckpt = torch.load(path, weights_only=False)
            got[name][kind] = {"losses": losses, "weights": weights(model),
                               "optimizer": ckpt["optimizer_states"],
                               "schedulers": ckpt["lr_schedulers"]}
    torch.save(got, out)


def refused(out):
    """Optimizers that cannot be rebuilt over there: refused before the first batch."""
    from somatize import Refused

    said = {}
    for name, kw in (("NeedsScale", {"scale": 2.0}), ("KeepsClip", {"clip": 0.5})):
        model = Net(name, **kw)
        try:
            fit(model, SomatizeStrategy(place={"encoder": "worker"}), max_steps=2)
            said[name] = ("fitted", None)
        except Refused as e:
            said[name] = (str(e), model.global_step)
    torch.save(said, out)


def after_fit(out):
    """A checkpoint written by trainer.save_checkpoint after fit returns, plain and placed,
    and each resumed plainly for one more epoch."""
    where = os.path.dirname(out)
    got = {}
    for kind, strategy in (("plain", lambda: "auto"),
                           ("split", lambda: SomatizeStrategy(place={"body": "worker"}))):
        pl.seed_everything(0)
        model = Body()
        trainer, losses = fit(model, strategy(), max_epochs=1)
        path = os.path.join(where, f"after-{kind}.ckpt")
        trainer.save_checkpoint(path)
        state_here = trainer.optimizers[0].state_dict()["state"]
        trainer.validate(model, data(32), verbose=False)  # a route that does not train
        validated = trainer.optimizers[0].state_dict()["state"]
        pl.seed_everything(1)
        resumed = Body()
        _, more = fit(resumed, "auto", ckpt=path, max_epochs=2)
        got[kind] = {"ckpt": torch.load(path, weights_only=False), "losses": losses,
                     "state_here": state_here, "module": weights(model),
                     "validated": validated,
                     "resumed": (more, weights(resumed))}
    torch.save(got, out)


class Started(pl.Callback):
    """Writes ``OUT.started`` once the first batch has trained (this process's pid, then
    its workers', which may be forked by another process than this one), then waits for
    ``OUT.go`` (the test lets one fit run at a time: the others idle, not competing for
    the CPU)."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0 and not os.path.exists(self.out + ".started"):
            ran = {pid for pids in trainer.strategy.where().values() for pid in pids}
            with open(self.out + ".started.part", "w") as f:
                f.write(" ".join(map(str, [os.getpid(), *sorted(ran - {os.getpid()})])))
            os.replace(self.out + ".started.part", self.out + ".started")  # whole, at once
            deadline = time.monotonic() + 600
            while not os.path.exists(self.out + ".go") and time.monotonic() < deadline:
                time.sleep(0.05)


def interrupted(out):
    """A placed fit that runs until Ctrl-C (the test sends SIGINT to this process alone)."""
    import signal

    # Python's own Ctrl-C, even when started from a shell that ignores SIGINT (a `&` job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model = Body()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, max_epochs=10_000, limit_val_batches=0,
                         strategy=SomatizeStrategy(place={"body": "worker"}),
                         callbacks=[Started(out)])
    trainer.fit(model, data(256))
    time.sleep(60)  # not reached: the fit ends with SIGINT


class DenseNet(nn.Module):
    """lightning-hydra-template's SimpleDenseNet, as it behaves: images flattened, then a
    ``model`` of three Linear-BatchNorm-ReLU blocks and a Linear head."""

    def __init__(self, size=64, hidden=32, classes=10):
        super().__init__()
        blocks = []
        for n_in in (size, hidden, hidden):
            blocks += [nn.Linear(n_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU()]
        self.model = nn.Sequential(*blocks, nn.Linear(hidden, classes))

    def forward(self, x):
        return self.model(x.view(x.size(0), -1))


class TemplateModule(pl.LightningModule):
    """lightning-hydra-template's MNISTLitModule, as it behaves: the net, the optimizer and
    scheduler factories kept by save_hyperparameters (the net in hparams too), torchmetrics
    for loss and accuracy, the optimizer built over ``self.trainer.model.parameters()``, a
    ReduceLROnPlateau on val/loss each epoch."""

    def __init__(self, net, optimizer, scheduler, compile=False):
        super().__init__()
        from torchmetrics import MaxMetric, MeanMetric
        from torchmetrics.classification import Accuracy

        self.save_hyperparameters(logger=False)
        self.net = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc, self.val_acc = (Accuracy(task="multiclass", num_classes=10)
                                        for _ in range(2))
        self.train_loss, self.val_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x):
        return self.net(x)

    def on_train_start(self):
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch):
        x, y = batch
        logits = self(x)
        return self.criterion(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch, i):
        loss, preds, y = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, y)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, i):
        loss, preds, y = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, y)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self):
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True)

    def configure_optimizers(self):
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss",
                                 "interval": "epoch", "frequency": 1}}


def images(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g)
    return tud.DataLoader(tud.TensorDataset(x, torch.randint(0, 10, (n,), generator=g)),
                          batch_size=16)


def template(out):
    """The template's module, unmodified, with net.model placed; checkpoints every epoch
    (ModelCheckpoint, save_last): last.ckpt, plain and placed."""
    import functools

    from lightning.pytorch.callbacks import ModelCheckpoint

    got = {}
    for kind, strategy in (("plain", lambda: "auto"),
                           ("split", lambda: SomatizeStrategy(place={"net.model": "worker"}))):
        pl.seed_everything(0)
        model = TemplateModule(
            DenseNet(), functools.partial(torch.optim.Adam, lr=1e-3, weight_decay=0.0),
            functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min",
                              factor=0.1, patience=0))
        where = os.path.join(os.path.dirname(out), f"template-{kind}")
        said = ""
        try:
            trainer = pl.Trainer(logger=False, enable_progress_bar=False,
                                 enable_model_summary=False, strategy=strategy(),
                                 max_epochs=3, default_root_dir=where,
                                 callbacks=[ModelCheckpoint(dirpath=where, save_last=True,
                                                            every_n_epochs=1)])
            trainer.fit(model, images(64, 0), images(32, 1))
        except Exception as e:  # noqa: BLE001 (what the run said, for the test to show)
            said = f"{type(e).__name__}: {e}"
        last = os.path.join(where, "last.ckpt")
        ckpt = torch.load(last, weights_only=False) if os.path.exists(last) else None
        if ckpt is not None:  # the net kept in hparams: its class lives in __main__ here
            net = ckpt["hyper_parameters"]["net"]
            ckpt = {k: ckpt[k] for k in ("epoch", "state_dict", "optimizer_states",
                                         "lr_schedulers")}
            ckpt["net"] = (type(net).__qualname__, net.state_dict())
        got[kind] = {"said": said, "ckpt": ckpt}
    torch.save(got, out)


def many(out, *cases):
    """Several runs in one process (one interpreter start, one worker), each saved beside
    ``out`` as ``<case>.pt``; ``optimizers:SGD,AdamW`` passes arguments."""
    keep_worker()
    for case in cases:
        name, _, args = case.partition(":")
        path = os.path.join(os.path.dirname(out), f"{name}.pt")
        globals()[name](path, *(args.split(",") if args else []))
    torch.save(list(cases), out)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
