"""Runs of a real lightning.Trainer on unmodified LightningModules, plain and with
SomatizeStrategy(place=...), each in its own process (RPC starts once per process);
tests/test_dropin.py calls them and reads what they save.

    python tests/dropin_runs.py transformer OUT.pt
"""

import collections
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


class Probe(nn.Module):
    """Answers, beside its output, the math settings of the process it runs in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, x):
        return {"y": self.lin(x), "threads": torch.get_num_threads(),
                "precision": torch.get_float32_matmul_precision(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "benchmark": torch._C._get_cudnn_benchmark(),  # (a CudnnModule does not pickle)
                "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


class Settings(pl.LightningModule):
    """Changes the math settings between batches; keeps what the encoder saw."""

    SET = [(1, "high", True, True), (2, "medium", False, False), (1, "highest", False, True)]

    def __init__(self):
        super().__init__()
        self.encoder = Probe()
        self.head = nn.Linear(8, 64)
        self.seen: list[tuple] = []

    def on_train_batch_start(self, batch, i):
        threads, precision, deterministic, benchmark = self.SET[i % len(self.SET)]
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.benchmark = benchmark
        if deterministic:  # as Lightning's deterministic=True does, for cuBLAS
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        else:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)

    def training_step(self, batch, i):
        x = batch[0]
        out = self.encoder(x)
        self.seen.append((out["threads"], out["precision"], out["deterministic"],
                          out["benchmark"], out["cublas"]))
        return F.mse_loss(self.head(out["y"]), x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def settings(out):
    """The math settings here travel with each call (and a Worker(threads=...) keeps its
    own count)."""
    from somatize.remote import Worker

    seen = {}
    for name, workers in (("followed", None), ("own", {"worker": Worker.embedded(threads=2)})):
        model = Settings()
        fit(model, SomatizeStrategy(place={"encoder": "worker"}, workers=workers), digits(),
            max_steps=6)
        seen[name] = model.seen
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.save(seen, out)


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


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        got = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.callback_metrics.get("loss", got)) if got is None
                           else got.item())


def fit(model, strategy, data=None, **kw):
    losses = Losses()
    trainer = pl.Trainer(logger=kw.pop("logger", False), enable_progress_bar=False,
                         enable_model_summary=False,
                         strategy=strategy, callbacks=[losses, *kw.pop("callbacks", [])],
                         **{"enable_checkpointing": False, **kw})
    trainer.fit(model, data)
    return trainer, losses.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def both(make, place, out, data=None, **kw):
    pl.seed_everything(0)
    _, plain_losses, plain = fit(model := make(), "auto", data, **kw)
    plain_vals = getattr(model, "vals", None)
    pl.seed_everything(0)
    strategy = SomatizeStrategy(place=place)
    _, split_losses, split = fit(model := make(), strategy, data, **kw)
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "vals": (plain_vals, getattr(model, "vals", None)),
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
    torch.save({**got, "vals": (None, None), "ran": s.where().get("", {}), "pid": os.getpid()},
               out)


def batchnorm(out):
    both(Normed, {"encoder": "worker"}, out, digits(), max_epochs=2, limit_val_batches=2)


def finetune_resumed(out):
    """Finetuned to epoch 2 (the backbone unfrozen at 1, its group added) and checkpointed
    plainly, then resumed to epoch 3 plainly and placed: the restored group's Adam state
    must reach the mirror."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    ckpt_dir = os.path.join(os.path.dirname(out), "finetune-ckpt")
    pl.seed_everything(0)
    fit(Finetuned(), "auto", digits(), max_epochs=2, enable_checkpointing=True,
        default_root_dir=ckpt_dir, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    ckpt = next(os.path.join(r, f) for r, _, fs in os.walk(ckpt_dir) for f in fs
                if f.endswith(".ckpt"))
    got = {}
    for name, strategy in (("plain", lambda: "auto"),
                           ("split", lambda: SomatizeStrategy(place={"backbone": "worker"}))):
        pl.seed_everything(1)
        model, losses = Finetuned(), Losses()
        trainer = pl.Trainer(logger=False, enable_progress_bar=False,
                             enable_model_summary=False, strategy=strategy(),
                             callbacks=[losses, BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
                             max_epochs=3, enable_checkpointing=False)
        trainer.fit(model, digits(), ckpt_path=ckpt)
        got[name] = (losses.losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    torch.save({**got, "vals": (None, None), "ran": {}, "pid": os.getpid()}, out)


def many_calls(out):
    both(Many, {"encoder": "worker"}, out, digits(), max_epochs=2)


def siamese_bf16(out):
    """The siamese module (two calls per step) under bf16-mixed autocast."""
    both(Siamese, {"encoder": "worker"}, out, digits(), max_epochs=1, precision="bf16-mixed")


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
        got[name] = [line for line in lines if line.startswith("module 'encoder'")]
    lines.clear()
    fit(AutoEncoder(), SomatizeStrategy(place={"encoder": "worker"}), digits(), max_steps=3,
        limit_val_batches=0, callbacks=[HooksDuringFit()])
    got["hooked"] = [line for line in lines if "hook" in line]
    logger.removeHandler(keep)
    torch.save(got, out)


class PlainAutoEncoder(AutoEncoder):
    """The autoencoder without dropout (the precision and clipping runs)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


PRECISION = {
    "bf16": {"precision": "bf16-mixed"},
    "norm": {"gradient_clip_val": 0.05},
    "value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    "bf16-norm": {"precision": "bf16-mixed", "gradient_clip_val": 0.05},
    "bf16-true": {"precision": "bf16-true"},
}


def precision(out, case):
    """Plain Lightning and the strategy under one precision / clipping setting."""
    if case == "16":  # Lightning makes 16-mixed on CPU bf16: ask for float16 by the plugin
        from lightning.pytorch.plugins import MixedPrecision

        def scaled():  # a scale that overflows float16 at first: steps are skipped
            return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler(
                "cpu", init_scale=2.0**24))]}

        kw, kw_twice = scaled(), scaled()
    else:
        kw = kw_twice = PRECISION[case]
    pl.seed_everything(0)
    _, as_is, _ = fit(PlainAutoEncoder(), "auto", digits(), max_epochs=2, limit_val_batches=1)
    pl.seed_everything(0)
    t, plain_losses, plain = fit(PlainAutoEncoder(), "auto", digits(), max_epochs=2,
                                 limit_val_batches=1, **kw)
    scales = [getattr(getattr(t.precision_plugin, "scaler", None), "get_scale", lambda: None)()]
    pl.seed_everything(0)
    strategy = SomatizeStrategy(place={"encoder": "worker"})
    t, split_losses, split = fit(PlainAutoEncoder(), strategy, digits(), max_epochs=2,
                                 limit_val_batches=1, **kw_twice)
    scales.append(getattr(getattr(t.precision_plugin, "scaler", None), "get_scale",
                          lambda: None)())
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "as_is": as_is, "scales": scales,
                "ran": strategy.where().get("", {}), "pid": os.getpid()}, out)


def devices(out):
    """A worker given device='cpu' explicitly trains exactly; one given a GPU it does not
    have says so, naming the device."""
    from somatize import WorkerError
    from somatize.remote import Worker

    pl.seed_everything(0)
    _, plain_losses, plain = fit(PlainAutoEncoder(), "auto", digits(), max_epochs=1)
    pl.seed_everything(0)
    on_cpu = SomatizeStrategy(place={"encoder": "worker"},
                              workers={"worker": Worker.embedded(device="cpu")})
    _, split_losses, split = fit(PlainAutoEncoder(), on_cpu, digits(), max_epochs=1)
    said = ""
    try:
        fit(PlainAutoEncoder(), SomatizeStrategy(
            place={"encoder": "worker"}, workers={"worker": Worker.embedded(device="cuda:0")}),
            digits(), max_epochs=1)
    except WorkerError as e:
        said = str(e)
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "said": said}, out)


def gpu(out):
    """On a machine with a GPU (scripts/gpu_check.sh): the local half on cuda:0, the encoder
    on a worker on cuda:0, under 32-true, bf16-mixed and 16-mixed: equal to plain?"""
    from somatize.remote import Worker

    report = {}
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        kw = {"accelerator": "gpu", "devices": 1, "precision": precision, "max_epochs": 1}
        pl.seed_everything(0)
        _, plain_losses, plain = fit(PlainAutoEncoder(), "auto", digits(), **kw)
        pl.seed_everything(0)
        strategy = SomatizeStrategy(place={"encoder": "worker"},
                                    workers={"worker": Worker.embedded(device="cuda:0")})
        _, split_losses, split = fit(PlainAutoEncoder(), strategy, digits(), **kw)
        same = all(torch.equal(plain[k].cpu(), split[k].cpu()) for k in plain)
        report[precision] = {"losses equal": split_losses == plain_losses,
                             "weights equal": same}
        print(precision, report[precision], flush=True)
    torch.save(report, out)


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


def many(out, *cases):
    """Several runs in one process (one interpreter start, RPC started once), each saved
    beside ``out`` as ``<case>.pt``: ``transformer``, ``precision:bf16``, ..."""
    for case in cases:
        name, _, arg = case.partition(":")
        path = os.path.join(os.path.dirname(out), f"{case.replace(':', '-')}.pt")
        globals()[name](path, *([arg] if arg else []))
    torch.save(list(cases), out)


def resumes(out):
    """The three resumes the test compares, in one process: plain from plain (the
    oracle: Lightning does not checkpoint the RNG), split from plain, plain from split."""
    got = {}
    for first, then in (("plain", "plain"), ("plain", "split"), ("split", "plain")):
        path = os.path.join(os.path.dirname(out), f"{first}-{then}.pt")
        resume(path, first, then)
        got[f"{first}-{then}"] = torch.load(path, weights_only=False)
    torch.save(got, out)


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
