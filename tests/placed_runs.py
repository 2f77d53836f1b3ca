"""A placed module stays an ordinary module: runs of a real lightning.Trainer, plain and
with SomatizeStrategy(place=...), on modules whose classes this script defines (so they
live in ``__main__`` and cross by value); tests/test_placed_ordinary.py reads what they
save. All cases in one process (RPC starts once):

    python tests/placed_runs.py many OUT.pt outputs raises attributes side cache pickles shapes
"""

import collections
import copy
import dataclasses
import os
import pickle
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402
from dropin_models import digits, fit  # noqa: E402
from placed_derived_runs import derived  # noqa: E402, F401 (a case of many)

from somatize.lightning import SomatizeStrategy  # noqa: E402


@dataclasses.dataclass
class Out:
    """A dataclass output, with a field its __init__ does not take."""

    h: torch.Tensor
    n: int
    twice: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.twice = self.h * 2


class LookAlikeOutput(collections.OrderedDict):
    """What transformers' ModelOutput does: a dataclass and an OrderedDict at once, whose
    __post_init__ fills the dict from the fields, and whose items are attributes too."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                self[f.name] = v

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        super().__setattr__(k, v)

    def __setattr__(self, k, v):
        if k in self.keys() and v is not None:
            super().__setitem__(k, v)
        super().__setattr__(k, v)


@dataclasses.dataclass
class Hidden(LookAlikeOutput):
    last_hidden_state: torch.Tensor = None
    pooled: torch.Tensor = None
    attentions: tuple = None


Pair = collections.namedtuple("Pair", "first second")


class Typed(nn.Module):
    """Answers a dataclass, a ModelOutput look-alike and a namedtuple."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.pool = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        hidden = Hidden(last_hidden_state=h, pooled=torch.tanh(self.pool(h)))
        return Out(h, x.shape[0]), hidden, Pair(h.sum(1), h.mean(1))


class Outputs(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = Typed()
        self.head = nn.Linear(8, 64)
        self.types = []

    def training_step(self, batch, i):
        x = batch[0]
        out, hidden, pair = self.encoder(x)
        self.types.append((type(out), type(hidden), type(pair),
                           hidden.pooled is hidden["pooled"], list(hidden.keys())))
        loss = (F.mse_loss(self.head(out.twice + hidden.last_hidden_state + hidden.pooled), x)
                + pair.first.mean() * 0.01 + out.n * 0)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def both(make, place, out, data=None, extra=None, **kw):
    pl.seed_everything(0)
    model = make()
    _, plain_losses, plain = fit(model, "auto", data, **kw)
    plain_seen = extra(model) if extra else None
    pl.seed_everything(0)
    strategy = SomatizeStrategy(place=place)
    model = make()
    _, split_losses, split = fit(model, strategy, data, **kw)
    got = {"plain": (plain_losses, plain), "split": (split_losses, split),
           "seen": (plain_seen, extra(model) if extra else None),
           "ran": strategy.where(), "pid": os.getpid()}
    torch.save(got, out)


def outputs(out):
    """Output types survive (the script's own classes), and train the placed weights."""
    both(Outputs, {"encoder": "worker"}, out, digits(), max_steps=4,
         extra=lambda m: [(tuple(c.__qualname__ for c in t[:3]), *t[3:]) for t in m.types]
         + [all(t[0] is Out and t[1] is Hidden and t[2] is Pair for t in m.types)])


class Odd(ValueError):
    """An exception class the script defines."""


class Raises(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(64, 8), kind

    def forward(self, x):
        if self.kind == "value":
            raise ValueError("the batch is odd")
        raise Odd("odder")


class RaisesModel(Outputs):
    def __init__(self, kind):
        super().__init__()
        self.encoder = Raises(kind)

    def training_step(self, batch, i):
        return self.encoder(batch[0]).sum()


def raises(out):
    """A ValueError raised in the placed forward arrives as a ValueError."""
    got = {}
    for kind in ("value", "odd"):
        try:
            fit(RaisesModel(kind), SomatizeStrategy(place={"encoder": "worker"}), digits(),
                max_steps=1)
        except Exception as e:
            got[kind] = {"type": type(e).__qualname__, "is": type(e) is (
                ValueError if kind == "value" else Odd), "message": str(e),
                         "cause": str(e.__cause__), "cause_type": type(e.__cause__).__name__}
    torch.save(got, out)


class Tunable(pl.LightningModule):
    """Dropout and BatchNorm in the placed encoder; a callback sets the dropout's p and
    Lightning's BaseFinetuning (train_bn=False) freezes the encoder at epoch 1, which sets
    BatchNorm's track_running_stats to False here."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Dropout(0.1), nn.Linear(32, 8))
        self.head = nn.Linear(8, 64)
        self.vals = []

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.head(self.encoder(x)), x)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, i):
        x = batch[0]
        self.vals.append(F.mse_loss(self.head(self.encoder(x)), x).item())

    def val_dataloader(self):
        return digits(32)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Freeze(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        pass

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.freeze(pl_module.encoder, train_bn=False)


class SetsP(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        pl_module.encoder[3].p = 0.1 + 0.2 * (i % 3)


def attributes(out):
    """Attributes set here reach the worker before its next call."""
    both(Tunable, {"encoder": "worker"}, out, digits(), max_epochs=3,
         callbacks=[Freeze(), SetsP()], extra=lambda m: m.vals)


class LeavesLoss(nn.Module):
    """Sets an auxiliary loss on itself in forward; a hook on a child keeps its features."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 16), nn.Tanh())
        self.out = nn.Linear(16, 8)
        self.body[0].register_forward_hook(lambda m, i, o: setattr(m, "features", o))

    def forward(self, x):
        h = self.body(x)
        self.aux = h.pow(2).mean()
        return self.out(h)


class Side(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = LeavesLoss()
        self.head = nn.Linear(8, 64)

    def training_step(self, batch, i):
        x = batch[0]
        loss = (F.mse_loss(self.head(self.encoder(x)), x) + 0.1 * self.encoder.aux
                + 0.01 * self.encoder.body[0].features.abs().mean())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def side(out):
    """What the forward leaves on its modules comes back, and trains the placed weights."""
    both(Side, {"encoder": "worker"}, out, digits(), max_steps=4)


class Cached(nn.Module):
    """Appends to the cache it is handed and writes into a tensor argument."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, x, cache, counter):
        h = self.lin(x)
        cache.append(h)
        counter += 1
        return h


class UsesCache(Side):
    def __init__(self):
        super().__init__()
        self.encoder = Cached()

    def training_step(self, batch, i):
        x, cache, counter = batch[0], [], torch.zeros(1)
        self.encoder(x, cache, counter)
        self.encoder(x * 0.5, cache, counter)
        loss = F.mse_loss(self.head(cache[0] + cache[1]), x) + counter.sum() * 0
        self.counts = (len(cache), counter.item())
        self.log("loss", loss)
        return loss


def cache(out):
    """Arguments the module changes in place over there change here too."""
    both(UsesCache, {"encoder": "worker"}, out, digits(), max_steps=4,
         extra=lambda m: m.counts)


class KeepsNet(pl.LightningModule):
    """lightning-hydra-template's habit: save_hyperparameters() keeps ``net`` (a module)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.head = nn.Linear(8, 64)

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.head(self.net(x)), x)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Copies(pl.Callback):
    """Pickles and deep-copies the placed module mid-fit (after each step): what the
    copies carry, and the class the module has."""

    def __init__(self):
        self.copies = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
        net = pl_module.net
        pickled = pickle.loads(pickle.dumps(net))
        self.copies.append((copy.deepcopy(net).state_dict(), pickled.state_dict()))
        self.seen = (type(net).__name__, "_compiled_call_impl" in pickled.__dict__,
                     type(copy.deepcopy(net)).__name__,
                     sorted({type(p).__name__ for p in pickled.parameters()}))


def pickles(out):
    """Checkpoints carry the module kept in hparams, with its weights; type unchanged."""
    got = {}
    for name, strategy in (("plain", "auto"), ("split", SomatizeStrategy(place={"net": "w"}))):
        pl.seed_everything(0)
        where = os.path.join(os.path.dirname(out), f"ckpt-{name}")
        copies = Copies()
        model = KeepsNet(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 8)))
        fit(model, strategy, digits(), max_epochs=2, enable_checkpointing=True,
            callbacks=[copies, ModelCheckpoint(dirpath=where, save_last=True)])
        ckpt = torch.load(os.path.join(where, "last.ckpt"), weights_only=False)
        got[name] = {"state": ckpt["state_dict"], "net": ckpt["hyper_parameters"]["net"]
                     .state_dict(), "optim": ckpt["optimizer_states"][0]["state"],
                     "seen": copies.seen, "copies": copies.copies}
    torch.save(got, out)


class Mean(pl.Callback):
    """A mean teacher: a target encoder here (not placed) follows the placed encoder's
    weights after each step; and the bytes received while steps run."""

    def __init__(self, follow=True):
        self.follow, self.received = follow, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
        if self.follow:
            with torch.no_grad():
                for t, o in zip(pl_module.target.parameters(), pl_module.encoder.parameters(),
                                strict=True):
                    t.mul_(0.9).add_(o.detach(), alpha=0.1)
        traffic = getattr(trainer.strategy, "traffic", None)
        self.received.append(traffic()[2] if traffic else 0)


class Teacher(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))
        self.target = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))
        self.target.requires_grad_(False)
        self.head = nn.Linear(8, 64)

    def training_step(self, batch, i):
        x = batch[0]
        h = self.encoder(x)
        loss = F.mse_loss(self.head(h), x) + F.mse_loss(h, self.target(x))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def readers(out):
    """Readers of the placed weights here get current values: Lightning's
    EMAWeightAveraging, a mean-teacher target; a fit without one brings none back."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    got = {}
    for name, strategy in (("plain", "auto"), ("split", SomatizeStrategy(place={
            "encoder": "w"})), ("quiet", SomatizeStrategy(place={"encoder": "w"}))):
        pl.seed_everything(0)
        mean, ema = Mean(follow=name != "quiet"), EMAWeightAveraging(decay=0.8)
        model = Teacher()
        _, losses, weights = fit(model, strategy, digits(), max_steps=6,
                                 callbacks=[mean, *([ema] if name != "quiet" else [])])
        got[name] = {"losses": losses, "weights": weights, "received": mean.received,
                     "ran": strategy.where() if name != "plain" else {}}
    got["weight_bytes"] = sum(p.numel() * 4 for p in Teacher().encoder.parameters())
    got["pid"] = os.getpid()
    torch.save(got, out)


class Compiles(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
        if i == 1:
            pl_module.encoder[2].compile()


def compiled(out):
    """An in-place compile() of a placed module is refused at once, naming it."""
    from somatize import Refused

    said = ""
    try:
        fit(Teacher(), SomatizeStrategy(place={"encoder": "w"}), digits(), max_steps=4,
            callbacks=[Compiles()])
    except Refused as e:
        said = str(e)
    torch.save({"said": said}, out)


class Shifts(nn.Module):
    """Answers one tensor, a tuple, a dict or one tensor twice, as it is asked from call to
    call; its output is scaled by a buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x, y=None, how="tensor", counter=None):
        h = self.lin(x) * self.scale
        if y is not None:
            h = h + y.mean()
        if counter is not None:
            counter += 1  # written in place: the caller's tensor counts
        if how == "tuple":
            return h, h * 2
        if how == "dict":
            return {"h": h}
        if how == "twice":
            return h, h
        return h


class CallsShifting(Side):
    """Calls ``Shifts`` five ways a step: its arguments tensors alone, with keyword
    tensors (one it writes into), with a string, and with one tensor twice; its output
    each of its shapes."""

    def __init__(self):
        super().__init__()
        self.encoder = Shifts()
        self.seen = []

    def training_step(self, batch, i):
        x = batch[0]
        a = self.encoder(x)
        b, c = self.encoder(x, x, "tuple")
        d = self.encoder(x, y=x + 1, counter=(n := torch.zeros(1)))
        e = self.encoder(x, how="dict")
        f, g = self.encoder(x, x, how="twice")
        self.seen.append((type(a).__name__, type(e).__name__, f is g, n.item()))
        loss = F.mse_loss(self.head((a + b + c + d + e["h"] + f + g) / 7), x)
        self.log("loss", loss)
        return loss


class ReplacesScale(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        if i == 2:  # a new tensor under the buffer's name, its version as the old one's
            pl_module.encoder.scale = torch.full((8,), 0.5)


def shapes(out):
    """Arguments and outputs whose structure changes from call to call come back as
    themselves; a buffer replaced here (a new tensor, not a write) reaches the worker."""
    both(CallsShifting, {"encoder": "worker"}, out, digits(), max_steps=4,
         callbacks=[ReplacesScale()], extra=lambda m: m.seen)


def many(out, *cases):
    oracle.many(globals(), out, cases)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
