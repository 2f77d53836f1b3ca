"""A placed module is the same object on both sides, at the edges: attributes of any kind
changed mid-fit, structure changed mid-fit, hooks put after placing, every backward
(create_graph, retain_graph, autograd.grad on the input), a residual across the cut, an
argument object changed in place, compile() before fit. Runs of a real
lightning.Trainer, plain and with SomatizeStrategy(place=...); tests/test_placed_edges.py
reads what they save. All cases in one process (RPC starts once):

    python tests/placed_edges_runs.py many OUT.pt attributes structure hooks ...
"""

import contextvars
import dataclasses
import enum
import functools
import os
import random
import sys
import threading
import types

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402
from dropin_models import digits, fit  # noqa: E402

from somatize import Refused  # noqa: E402
from somatize.lightning import SomatizeStrategy  # noqa: E402


def _kept(live, name):
    return len(live.catalog[name].kept)


class Kept(pl.Callback):
    """How many calls' graphs the worker keeps after each step (freed as the graphs here
    are: it must not grow)."""

    def __init__(self, name="encoder"):
        self.name, self.counts = name, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
        strategy = trainer.strategy
        if isinstance(strategy, SomatizeStrategy):  # (the part's name: part() or session())
            part = getattr(strategy, "part", None) or strategy.session
            self.counts.append(part(self.name).call("worker", _kept, self.name))


def both(make, out, place=None, data=None, extra=None, **kw):
    """Plain Lightning, then placed; what each gave (losses, weights, ``extra``), and what
    the worker keeps after each step."""
    got = {}
    for name in ("plain", "split"):
        pl.seed_everything(0)
        strategy = "auto" if name == "plain" else SomatizeStrategy(
            place=place or {"encoder": "worker"})
        model = make()
        kept = Kept(next(iter(place or {"encoder": 0})))
        _, losses, weights = fit(model, strategy, data or digits(),
                                 **{**kw, "callbacks": [*kw.get("callbacks", []), kept]})
        got[name] = (losses, weights)
        got[f"{name}_seen"] = extra(model) if extra else None
        if name == "split":
            got["ran"] = strategy.where()
            got["kept"] = kept.counts
    got["pid"] = os.getpid()
    torch.save(got, out)


def refused(make, out, place="encoder", data=None, **kw):
    """What a placed fit of ``make()`` was refused with."""
    said = ""
    try:
        fit(make(), SomatizeStrategy(place={place: "worker"}), data or digits(), **kw)
    except Refused as e:
        said = str(e)
    torch.save({"said": said}, out)


class Base(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 64)

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.head(self.encoder(x)), x)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- (1) attributes of any kind -------------------------------------------------------

class Mode(enum.Enum):
    TANH = 1
    SIN = 2


class Reads(nn.Module):
    """Its forward reads attributes of every kind."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.shift = torch.zeros(8)  # a tensor attribute (not a buffer)
        self.scales = [1.0]
        self.cfg = {"gain": 1.0}
        self.act = torch.tanh
        self.mode = Mode.TANH
        self.temp = np.float32(1.0)

    def forward(self, x):
        h = self.act(self.lin(x)) * self.scales[-1] * self.cfg["gain"] / float(self.temp)
        h = h + self.shift
        return torch.sin(h) if self.mode is Mode.SIN else h


class ChangesEverything(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        enc = pl_module.encoder
        if i == 1:
            enc.shift = torch.full((8,), 0.1)  # replaced
            enc.scales.append(0.5)  # a list changed in place
            enc.cfg["gain"] = 1.5  # a dict changed in place
        if i == 2:
            enc.act = functools.partial(F.leaky_relu, negative_slope=0.2)
            enc.mode = Mode.SIN
            enc.temp = np.float32(2.0)
            enc.shift.add_(0.05)  # a tensor written in place
        if i == 3:
            enc.act = lambda t: t * torch.sigmoid(t)  # the script's: by value
            del enc.cfg["gain"]
            enc.cfg["gain"] = 0.75


class Attributes(Base):
    def __init__(self):
        super().__init__()
        self.encoder = Reads()


def attributes(out):
    both(Attributes, out, max_steps=5, callbacks=[ChangesEverything()])


class SetsLock(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        if i == 1:
            pl_module.encoder.lin.guard = threading.Lock()


def unpicklable(out):
    refused(Attributes, out, max_steps=3, callbacks=[SetsLock()])


# -- (2) structure and hooks ----------------------------------------------------------

class Grows(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x):
        h = self.body(x)
        if hasattr(self, "offset"):
            h = h + self.offset
        if hasattr(self, "extra"):
            h = h + self.extra(h)
        return h


class Restructures(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        enc = pl_module.encoder
        if i == 1:
            enc.body[1] = nn.ReLU()  # a child replaced
            enc.register_buffer("offset", torch.full((8,), 0.25))  # a buffer registered
        if i == 2:
            torch.manual_seed(5)
            enc.extra = nn.Linear(8, 8)  # a child added (the optimizers here do not hold it)
        if i == 3:
            enc.body[2].register_parameter("bias", nn.Parameter(torch.ones(8)))


class Structure(Base):
    def __init__(self):
        super().__init__()
        self.encoder = Grows()


def structure(out):
    both(Structure, out, max_steps=5, callbacks=[Restructures()],
         extra=lambda m: sorted(m.encoder.state_dict()))


class OwnHook(Base):
    """A hook on the placed module itself that writes outside it (a dict of the model's),
    and, put after placing, a hook on a child that sets an attribute on its module."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))
        self.seen = {}
        self.encoder.register_forward_hook(self._keep)

    def _keep(self, m, args, out):
        self.seen["out"] = out

    def training_step(self, batch, i):
        x = batch[0]
        h = self.encoder(x)
        loss = F.mse_loss(self.head(self.seen["out"]), x) + 0 * h.sum()
        feats = getattr(self.encoder[1], "features", None)
        if feats is not None:
            loss = loss + 0.1 * feats.pow(2).mean()
        self.log("loss", loss)
        return loss


class HooksLater(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        if i == 1:
            self.handle = pl_module.encoder[1].register_forward_hook(
                lambda m, a, o: setattr(m, "features", o))
        if i == 3:
            self.handle.remove()
            pl_module.encoder[1].__dict__.pop("features", None)


def hooks(out):
    both(OwnHook, out, max_steps=5, callbacks=[HooksLater()])


FEATURES = []


class HookWritesOutside(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        if i == 1:
            pl_module.encoder[1].register_forward_hook(lambda m, a, o: FEATURES.append(o))


class Sequential(Base):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))


def hook_outside(out):
    refused(Sequential, out, max_steps=3, callbacks=[HookWritesOutside()])


class LayerDrop(nn.Module):
    """Older Hugging Face layerdrop: in training, a layer is skipped when a draw from a
    global generator (Python's random.uniform, or numpy's) is under p."""

    def __init__(self, draw):
        super().__init__()
        self.first, self.last = nn.Linear(64, 64), nn.Linear(64, 8)
        self.draw = draw

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if self.training and (random.uniform(0, 1) if self.draw == "random"
                              else np.random.uniform(0, 1)) < 0.5:
            h = x  # the layer dropped
        return self.last(h)


class Drawing(Base):
    def __init__(self, draw):
        super().__init__()
        self.encoder = LayerDrop(draw)


def draws_random(out):
    refused(lambda: Drawing("random"), out, max_steps=3)


def draws_numpy(out):
    refused(lambda: Drawing("numpy"), out, max_steps=3)


def global_hook(out):
    # a hook every module runs (activation statistics, say), registered before the fit
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        refused(Sequential, out, max_steps=3)
    finally:
        handle.remove()


GAIN = 1.0  # module-level settings the encoder's code reads: a number,
CFG = {"shift": 0.0}  # a config dict (read by a helper it calls),
ACT = torch.tanh  # and a function


@dataclasses.dataclass
class Knobs:
    scale: float = 1.0


KNOBS = Knobs()  # config objects: a dataclass's instance
OPTS = types.SimpleNamespace(bias=0.0)  # and a namespace (parse_args() gives one alike)


def _shifted(h):
    return h + CFG["shift"]


class Gained(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, x):
        return _shifted(ACT(self.lin(x)) * GAIN) * KNOBS.scale + OPTS.bias


class SetsGlobals(pl.Callback):
    """Before each batch: GAIN rebound to a new value (or to an equal one), CFG changed in
    place, or ACT rebound to another function."""

    def __init__(self, how):
        self.how = how

    def on_train_batch_start(self, trainer, pl_module, batch, i):
        global GAIN, ACT
        if self.how == "rebound":
            GAIN = float(1 + i)
        elif self.how == "same":
            GAIN = float(str(GAIN))  # another object, the same value
        elif self.how == "in_place":
            CFG["shift"] = 0.1 * i  # the same dict
        elif self.how == "record":
            KNOBS.scale = 1.0 + 0.5 * i  # a field of the same object
            OPTS.bias = 0.01 * i
        elif i == 1:
            ACT = torch.sigmoid


class Gains(Base):
    def __init__(self):
        super().__init__()
        self.encoder = Gained()


def _globals_case(how, out, run):
    global GAIN, ACT

    def make():  # each fit starts from the same settings
        global GAIN, ACT
        GAIN, ACT = 1.0, torch.tanh
        CFG["shift"], KNOBS.scale, OPTS.bias = 0.0, 1.0, 0.0
        return Gains()

    try:
        run(make, out, max_steps=5, callbacks=[SetsGlobals(how)])
    finally:
        GAIN, ACT = 1.0, torch.tanh
        CFG["shift"], KNOBS.scale, OPTS.bias = 0.0, 1.0, 0.0


def global_rebound(out):
    _globals_case("rebound", out, both)


def global_same(out):
    _globals_case("same", out, both)


def global_in_place(out):
    _globals_case("in_place", out, both)


def global_record(out):
    _globals_case("record", out, both)


def global_to_code(out):
    _globals_case("code", out, refused)


COLLECTOR = contextvars.ContextVar("collector", default=None)


class Collects(pl.LightningModule):
    """Hugging Face's output_hidden_states, in miniature: the model's forward sets a
    collector in a ContextVar here and, the first time, puts hooks on the encoder's layers
    (local closures) that append each layer's output to it."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 64)
        self.hooked = False
        self.seen = []

    def training_step(self, batch, i):
        x = batch[0]
        if not self.hooked:
            for layer in self.encoder:
                def hook(m, a, o, collected=COLLECTOR):
                    if collected.get() is not None:
                        collected.get().append(o)
                layer.register_forward_hook(hook)
            self.hooked = True
        states = []
        token = COLLECTOR.set(states)
        try:
            h = self.encoder(x)
        finally:
            COLLECTOR.reset(token)
        loss = F.mse_loss(self.head(h), x) + 0.01 * sum(s.mean() for s in states)
        self.seen.append(len(states))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def contextvar(out):
    both(Collects, out, max_steps=4, extra=lambda m: m.seen)


# -- (3) every backward ---------------------------------------------------------------

class Pinn(pl.LightningModule):
    """A PINN: the loss holds du/dx, taken with create_graph=True through the placed net."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale = nn.Parameter(torch.ones(1))

    def training_step(self, batch, i):
        x = batch[0][:, :2].clone().requires_grad_()
        u = self.encoder(x) * self.scale
        du, = torch.autograd.grad(u.sum(), x, create_graph=True)
        loss = (du[:, 0] - torch.cos(x[:, 1])).pow(2).mean() + u.pow(2).mean() * 0.1
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def pinn(out):
    both(Pinn, out, max_steps=4)


class WganGp(pl.LightningModule):
    """WGAN-GP with the critic placed: the gradient penalty differentiates through it."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 64), nn.Tanh())
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def training_step(self, batch, i):
        real = batch[0]
        opt_g, opt_c = self.optimizers()
        z = torch.randn(real.shape[0], 8)
        fake = self.gen(z).detach()
        eps = torch.rand(real.shape[0], 1)
        mix = (eps * real + (1 - eps) * fake).requires_grad_()
        g, = torch.autograd.grad(self.encoder(mix).sum(), mix, create_graph=True)
        gp = (g.norm(dim=1) - 1).pow(2).mean()
        c_loss = self.encoder(fake).mean() - self.encoder(real).mean() + 10 * gp
        opt_c.zero_grad()
        self.manual_backward(c_loss)
        opt_c.step()
        g_loss = -self.encoder(self.gen(z)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log("loss", c_loss + g_loss)
        return (c_loss + g_loss).detach()

    def configure_optimizers(self):
        return (torch.optim.Adam(self.gen.parameters(), lr=1e-3),
                torch.optim.Adam(self.encoder.parameters(), lr=1e-3))


def wgan(out):
    both(WganGp, out, max_steps=6)


class Twice(pl.LightningModule):
    """Manual optimization: an R1 penalty (grad of the placed critic's output on the real
    input, create_graph), then two backwards through one graph (retain_graph)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 64)

    def training_step(self, batch, i):
        x = batch[0].clone().requires_grad_()
        opt = self.optimizers()
        opt.zero_grad()
        h = self.encoder(x)
        g, = torch.autograd.grad(h.sum(), x, create_graph=True)
        r1 = g.pow(2).sum(1).mean()
        loss = F.mse_loss(self.head(h), batch[0])
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(0.1 * r1 + h.pow(2).mean())
        opt.step()
        self.log("loss", loss)
        return loss.detach()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def twice(out):
    both(Twice, out, max_steps=4)


class Heat(Pinn):
    """A PINN of second order (du/dx and d2u/dx2, each with create_graph=True) whose
    residual's weight is a parameter here, given as grad_outputs (a gradient that asks
    for one back)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), 0.5))

    def training_step(self, batch, i):
        x = batch[0][:, :2].clone().requires_grad_()
        u = self.encoder(x)
        v = self.weight.expand_as(u)
        du, = torch.autograd.grad(u, x, grad_outputs=v, create_graph=True)
        d2u, = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
        loss = (d2u[:, 0] - du[:, 1]).pow(2).mean() + (u * self.scale).pow(2).mean()
        self.log("loss", loss)
        return loss


def heat(out):
    both(Heat, out, max_steps=4)


class TwoAnswers(Pinn):
    """Two create_graph answers of one call, both in the loss with the call's output."""

    def training_step(self, batch, i):
        x = batch[0][:, :2].clone().requires_grad_()
        u = self.encoder(x)
        a, = torch.autograd.grad(u[:, 0].sum(), x, create_graph=True)
        b, = torch.autograd.grad((u[:, 0] ** 2).sum(), x, create_graph=True)
        loss = (a - b).pow(2).mean() + (u * self.scale).pow(2).mean()
        self.log("loss", loss)
        return loss


def two_answers(out):
    both(TwoAnswers, out, max_steps=4)


class StemPenalty(pl.LightningModule):
    """A gradient penalty on the placed module's argument, computed here by a stem and
    used twice over there (two calls), with AdamW."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 8)
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, i):
        h = self.stem(batch[0])
        u = self.encoder(h) + self.encoder(h * 2)
        g, = torch.autograd.grad(u.sum(), h, create_graph=True)
        loss = g.pow(2).mean() + u.pow(2).mean() + h.pow(2).mean() * 0.1
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def stem_penalty(out):
    both(StemPenalty, out, max_steps=4)


class Fgsm(pl.LightningModule):
    """FGSM by hand: autograd.grad on the input (which must not touch the weights' .grad),
    then the loss on the perturbed input."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 64)

    def training_step(self, batch, i):
        opt = self.optimizers()
        opt.zero_grad()  # first: the grad on the input below must add nothing to .grad
        x = batch[0].clone().requires_grad_()
        loss = F.mse_loss(self.head(self.encoder(x)), batch[0])
        g, = torch.autograd.grad(loss, x)
        adv = (x + 0.05 * g.sign()).detach()
        adv_loss = F.mse_loss(self.head(self.encoder(adv)), batch[0])
        self.manual_backward(adv_loss)
        opt.step()
        self.log("loss", adv_loss)
        return adv_loss.detach()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fgsm(out):
    both(Fgsm, out, max_steps=4)


# -- (4) a residual across the cut ----------------------------------------------------

class Residual(pl.LightningModule):
    """A tensor used inside the placed block once and outside it twice (a residual)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(64, 16)
        self.encoder = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 64)

    def training_step(self, batch, i):
        x = batch[0]
        h = self.pre(x)
        y = self.encoder(h) + h
        loss = F.mse_loss(self.head(y * h), x)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def residual(out):
    both(Residual, out, max_steps=4)


class Fans(nn.Module):
    """Uses its argument three times."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, h):
        return torch.tanh(self.a(h)) * h + self.b(h)


class FansOut(Residual):
    """A tensor used three times inside the placed module and twice outside it, after."""

    def __init__(self):
        super().__init__()
        self.encoder = Fans()

    def training_step(self, batch, i):
        x = batch[0]
        h = self.pre(x)
        y = self.encoder(h)
        loss = F.mse_loss(self.head(y * h + h.pow(2)), x)
        self.log("loss", loss)
        return loss


def fan_out(out):
    both(FansOut, out, max_steps=4)


# -- (5) compile() before fit ---------------------------------------------------------

def compiled_before(out):
    def make():
        model = Sequential()
        model.encoder[2].compile()
        return model

    refused(make, out, max_steps=2)


# -- (6) an argument object changed in place (a KV cache) ---------------------------

class KV:
    """A cache object the module appends to (what transformers' DynamicCache is)."""

    def __init__(self):
        self.keys = []


class Attends(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, x, cache):
        k = self.lin(x)
        cache.keys.append(k)
        return torch.stack(cache.keys).mean(0)


class Generates(pl.LightningModule):
    """Validation calls the placed module three times with one cache, under no_grad."""

    def __init__(self):
        super().__init__()
        self.encoder = Attends()
        self.head = nn.Linear(8, 64)
        self.vals = []

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.head(self.encoder(x, KV())), x)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, cache = batch[0], KV()
        outs = [self.encoder(x * s, cache) for s in (1.0, 0.5, 0.25)]
        self.vals.append((len(cache.keys), [o.sum().item() for o in outs]))

    def val_dataloader(self):
        return digits(32)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def kv_cache(out):
    both(Generates, out, max_epochs=2, limit_train_batches=3, extra=lambda m: m.vals)


# -- (7) an exception of the script's class, caught in the LightningModule -----------

class OutOfRange(Exception):
    """Two required arguments its __init__ turns into a message (so args is not them)."""

    def __init__(self, idx, limit):
        super().__init__(f"index {idx} over {limit}")
        self.idx, self.limit = idx, limit
        self.seen = [idx]


class Checks(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self.limit = 10

    def forward(self, x):
        if self.limit < 10:
            raise OutOfRange(12, self.limit)
        return self.lin(x)


class Catches(Base):
    def __init__(self):
        super().__init__()
        self.encoder = Checks()
        self.caught = None

    def training_step(self, batch, i):
        if i == 1:
            self.encoder.limit = 5
            try:
                self.encoder(batch[0])
            except OutOfRange as e:
                self.caught = (type(e) is OutOfRange, type(e).__name__, e.idx, e.limit,
                               e.seen, e.args, str(e))
            self.encoder.limit = 10
        return super().training_step(batch, i)


def raised(out):
    model = Catches()
    fit(model, SomatizeStrategy(place={"encoder": "worker"}), digits(), max_steps=2)
    torch.save({"caught": model.caught}, out)


# -- (8) what is refused before the first step, in the words of place= ---------------

class Layers(Base):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList([nn.Linear(64, 8)])

    def training_step(self, batch, i):
        return F.mse_loss(self.head(self.encoder[0](batch[0])), batch[0])


def module_list(out):
    refused(Layers, out, max_steps=1)


class TakesAnything(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, x, steps=None):
        return self.lin(x)


class PassesAGenerator(Base):
    def __init__(self):
        super().__init__()
        self.encoder = TakesAnything()

    def training_step(self, batch, i):
        h = self.encoder(batch[0], steps=(k for k in range(3)))
        return F.mse_loss(self.head(h), batch[0])


def generator_argument(out):
    refused(PassesAGenerator, out, max_steps=1)


def normed(parametrized):
    norm = torch.nn.utils.parametrizations.weight_norm if parametrized \
        else torch.nn.utils.weight_norm
    model = Sequential()
    model.encoder[2] = norm(nn.Linear(16, 8))
    return model


def parametrized(out):
    refused(lambda: normed(True), out, max_steps=1)


def weight_norm_hook(out):
    both(lambda: normed(False), out, max_steps=4)


def many(out, *cases):
    oracle.many(globals(), out, cases)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
