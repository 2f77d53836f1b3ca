"""What ``SomatizeCache`` keeps is what would be computed: a setting, a non-persistent
buffer or the call's precision changed since the store was filled is a new name; the
types of outputs come back as they went in, on the module's device; every stage is
counted in its own name. Each against the module frozen by hand, bit for bit, with a
real lightning.Trainer and a real store on disk."""

import logging
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from oracle import Losses
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from somatize import Graph, Refused
from somatize._store_cli import main as store_main
from somatize.lightning import SomatizeCache
from somatize.store import Store
from somatize.torch import freeze, node
from somatize.torch.cache._cached import CachedForward, on_device


class Body(nn.Module):
    """A frozen encoder with settings a key must see: BatchNorm's eps, an activation's
    slope, a plain float scale, a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.05, 0.2)
        self.act = nn.LeakyReLU(0.1)
        self.register_buffer("shift", torch.zeros(6), persistent=False)
        self.scale = 1.0

    def forward(self, x):
        return self.act(self.bn(self.lin(x))) * self.scale + self.shift


class Feat(NamedTuple):
    feat: torch.Tensor
    first: torch.Tensor


@dataclass
class FeatBox:
    feat: torch.Tensor
    n: int = 0


class Output(OrderedDict):
    """A look-alike of transformers' ModelOutput: an OrderedDict read by attribute."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


class Typed(Body):
    """The body, answering in a class of its own."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        h = super().forward(x)
        if self.kind == "namedtuple":
            return Feat(h, h[:, 0])
        if self.kind == "dataclass":
            return FeatBox(h, 3)
        return Output(feat=h, first=h[:, 0])


class Model(pl.LightningModule):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.head = nn.Linear(6, 3)

    def features(self, x):
        out = self.body(x)
        return out if isinstance(out, torch.Tensor) else out.feat

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.features(x)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.head(self.features(x)), y))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.head(self.features(batch[0]))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


class Computes(pl.Callback):
    """How often the body's own first layer ran, per training epoch (not on a hit)."""

    def __init__(self):
        self.per_epoch = []

    def on_train_epoch_start(self, trainer, pl_module):
        if not self.per_epoch:
            pl_module.body.lin.register_forward_hook(lambda *_: self.count())
        self.per_epoch.append(0)

    def count(self):
        if self.per_epoch:
            self.per_epoch[-1] += 1


def data(shuffle=False, n=64):
    g = torch.Generator().manual_seed(n)  # validation (32 rows) is not training's first half
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=shuffle)


def model(body=Body, change=None):
    pl.seed_everything(0)
    m = Model(body())
    if change is not None:
        change(m.body)
    return m


def trainer(epochs=2, callbacks=(), **kw):
    return pl.Trainer(max_epochs=epochs, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, logger=False, num_sanity_val_steps=0,
                      callbacks=list(callbacks), **kw)


def fit(m, store=None, epochs=2, shuffle=False, extra=(), **kw):
    """Losses and weights of a fit: cached in ``store``, else the body frozen by hand."""
    losses = Losses()
    callbacks = [losses, *extra]
    if store is not None:
        callbacks.append(SomatizeCache(store, modules=["body"]))
    else:
        m.body.requires_grad_(False).eval()
    t = trainer(epochs, callbacks, **kw)
    t.fit(m, data(shuffle), data(n=32))
    return losses.losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def assert_same(got, want):
    (losses, weights), (plain_losses, plain) = got, want
    assert losses == plain_losses and len(losses) > 0
    assert weights.keys() == plain.keys()
    assert all(torch.equal(weights[k], plain[k]) for k in plain)


# -- stale hits: whatever changes the output changes its name -----------------------------

def _eps(b):
    b.bn.eps = 0.1


def _scale(b):
    b.scale = 1.5


def _shift(b):
    b.shift.fill_(0.25)


def _slope(b):
    b.act.negative_slope = 0.3


@pytest.mark.parametrize("change", [_eps, _scale, _shift, _slope],
                         ids=["eps", "scale", "non-persistent buffer", "a child's slope"])
def test_a_setting_changed_after_the_store_was_filled_is_computed_anew(tmp_path, change):
    fit(model(), tmp_path)  # fills the store with the outputs of the unchanged body
    got = fit(model(change=change), tmp_path)
    assert_same(got, fit(model(change=change)))


class Tokenizer:
    """An object no key can name."""


def test_an_attribute_the_key_cannot_name_is_refused_at_setup_unless_salted(tmp_path):
    def with_tokenizer(b):
        b.bn.tok = Tokenizer()

    with pytest.raises(Refused, match=r"module 'body'.*'bn\.tok' holds a Tokenizer.*salt="):
        fit(model(change=with_tokenizer), tmp_path)
    m = model(change=with_tokenizer)
    losses = Losses()
    t = trainer(1, [losses, SomatizeCache(tmp_path, modules=["body"], salt="tok-v1")])
    t.fit(m, data())
    assert len(losses.losses) == 4


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.lin = self.inner.lin  # what Computes hooks

    def forward(self, x):
        return self.inner(x).relu()


class EditedInner(nn.Module):
    def forward(self, x):
        return self.lin(x) * 2


EditedInner.__qualname__ = EditedInner.__name__ = "Inner"  # the same class, its code edited


def test_editing_a_submodules_forward_is_said_on_a_hit(tmp_path, say_again, said):
    fit(model(Outer), tmp_path)
    assert "Inner.forward" not in said()

    def edited(b):
        b.inner.__class__ = EditedInner

    fit(model(Outer, change=edited), tmp_path, epochs=1)
    assert "Inner.forward changed since" in said()


# -- precision is in the key ---------------------------------------------------------------

@pytest.mark.parametrize("filled,then", [("32-true", "bf16-mixed"), ("bf16-mixed", "32-true")])
def test_a_store_filled_at_one_precision_computes_anew_at_another(tmp_path, filled, then):
    fit(model(), tmp_path, precision=filled)
    assert_same(fit(model(), tmp_path, precision=then), fit(model(), precision=then))


# -- types come back as they went in ------------------------------------------------------

@pytest.mark.parametrize("kind", ["namedtuple", "dataclass", "mapping"])
def test_an_output_of_its_own_class_comes_back_as_that_class(tmp_path, kind):
    computes = Computes()
    got = fit(model(lambda: Typed(kind)), tmp_path, epochs=3, extra=[computes])
    assert_same(got, fit(model(lambda: Typed(kind)), epochs=3))
    assert computes.per_epoch == [6, 0, 0]  # 4 training, 2 validation batches: kept, then read
    kept = Store(tmp_path).get_many([f"value/{n.name}" for n in (tmp_path / "names" / "value")
                                     .iterdir()])
    want = {"namedtuple": Feat, "dataclass": FeatBox, "mapping": Output}[kind]
    assert kept and all(type(k.value) is want for k in kept)


def _posing_as(path, kind):
    """A value whose class says it is ``path`` (module:qualname), kept as ``kind``."""
    module, _, qualname = path.partition(":")
    if kind == "namedtuple":
        class Posing(NamedTuple):
            a: int

        cls = Posing
    elif kind == "dataclass":
        cls = dataclass(type("Posing", (), {"__annotations__": {"a": int}}))
    else:
        cls = type("Posing", (dict,), {})
    cls.__module__, cls.__qualname__ = module, qualname
    return cls(a=1) if kind != "mapping" else cls(a=1)


@pytest.mark.parametrize("path,kind,why", [
    ("never_imported_xyz:Feat", "namedtuple", "is not imported in this process"),
    ("os:PathLike", "mapping", "is no longer a mapping"),
    ("collections:Counter", "dataclass", "is no longer a dataclass"),
    ("os:no_such_class", "namedtuple", "has no class"),
])
def test_a_class_not_imported_or_not_of_its_kind_is_never_imported_nor_built(
        tmp_path, say_again, said, path, kind, why):
    store = Store(tmp_path / "s")
    name = "value/" + "ab" * 32
    assert store.put(name, _posing_as(path, kind))
    assert store.get(name) is None  # a miss: computed again, said why
    assert why in said() and "never_imported_xyz" not in sys.modules


# -- edges ---------------------------------------------------------------------------------

def test_validate_test_and_predict_are_counted_and_logged_in_their_own_names(tmp_path):
    m, cache = model(), SomatizeCache(tmp_path, modules=["body"])
    t = trainer(2, [cache])
    t.fit(m, data(), data(n=32))
    assert cache.stages.totals == {"train": (4, 4), "val": (2, 2)}
    assert (cache.hits, cache.misses) == (6, 6)
    t.validate(m, data(n=32))
    assert t.callback_metrics["cache/val_hits"] == 2
    t.test(m, data(n=32))
    assert t.callback_metrics["cache/test_hits"] == 2 and t.callback_metrics[
        "cache/test_misses"] == 0
    t.predict(m, data(n=32))
    assert cache.stages.totals == {"train": (4, 4), "val": (4, 2), "test": (2, 0),
                                   "predict": (2, 0)}


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_store_path_that_is_a_file_is_refused_at_setup_naming_it(tmp_path, under):
    afile = tmp_path / "afile"
    afile.write_text("not a store")
    with pytest.raises(Refused, match=rf"{afile} is a file, not a directory"):
        fit(model(), afile / under if under else afile)


def test_store_du_says_the_disk_space_used_beside_the_bytes_kept(tmp_path, capsys):
    store = Store(tmp_path / "s")
    for i in range(40):
        store.put("value/" + f"{i:02x}" * 32, i)
    assert store_main(["du", str(store.path)]) == 0
    out = capsys.readouterr().out
    du = subprocess.run(["du", "-s", "-B1", str(store.path)], capture_output=True, text=True,
                        check=True)
    on_disk = int(du.stdout.split()[0])
    assert "40 names" in out and f"on disk {on_disk / 1024:.1f} KB" in out


def test_a_shuffled_whole_batch_cache_that_never_hits_says_why_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        fit(model(), tmp_path, epochs=3, shuffle=True)
    said = [r.getMessage() for r in caplog.records if "per_item=True" in r.getMessage()]
    assert len(said) == 1 and "shuffles" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fit(model(), tmp_path / "b", epochs=3)  # unshuffled: it hits, nothing to say
    assert not [r for r in caplog.records if "per_item=True" in r.getMessage()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["tensor", "namedtuple", "mapping"])
def test_a_value_read_from_the_store_comes_back_on_the_modules_device(tmp_path, kind):
    torch.manual_seed(0)
    body = (Body() if kind == "tensor" else Typed(kind)).cuda().eval().half()
    body.forward = cached = CachedForward(body, "body", str(tmp_path))
    x = torch.randn(4, 8, device="cuda", dtype=torch.half)
    first, again = body(x), body(x)
    assert (cached.hits, cached.misses) == (1, 1)
    for want, got in [(first, again)] if kind == "tensor" else zip(
            [first.feat, first.first], [again.feat, again.first], strict=True):
        assert got.device == want.device and got.dtype == torch.half and torch.equal(got, want)
    assert type(again) is type(first)


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass", "mapping"])
def test_a_value_is_moved_to_a_device_keeping_its_class_and_dtypes(kind):
    h = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    value = {"namedtuple": Feat(h, h[:, 0].half()), "dataclass": FeatBox(h, 3),
             "mapping": Output(feat=h, first=h[:, 0].half())}[kind]
    moved = on_device(value, torch.device("meta"))
    assert type(moved) is type(value) and moved.feat.device.type == "meta"
    assert moved.feat.dtype == torch.float64
    if kind != "dataclass":
        assert moved.first.device.type == "meta" and moved.first.dtype == torch.half
    else:
        assert moved.n == 3


# -- the graph route names the same way ------------------------------------------------------

def test_on_the_graph_route_a_setting_and_the_autocast_state_are_in_the_name(tmp_path):
    torch.manual_seed(0)
    body = Body()
    g = freeze(Graph.somatize(node(body).frozen().cached()))
    x = torch.randn(4, 8)
    assert torch.equal(g.forward(x, store=tmp_path), body(x))
    body.bn.eps = 0.1
    freeze(g)  # settled again: the digest covers the settings
    full = g.forward(x, store=tmp_path)
    assert torch.equal(full, body(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = g.forward(x, store=tmp_path)
        assert torch.equal(low, body(x)) and not torch.equal(low, full)
    assert torch.equal(g.forward(x, store=tmp_path), full)  # autocast off again: a hit


def test_on_the_graph_route_editing_a_submodules_forward_is_said_on_a_hit(tmp_path, say_again,
                                                                        said):
    torch.manual_seed(0)
    outer = Outer().eval()
    g = freeze(Graph.somatize(node(outer).frozen().cached()))
    x = torch.randn(4, 8)
    first = g.forward(x, store=tmp_path)
    outer.inner.__class__ = EditedInner
    assert torch.equal(g.forward(x, store=tmp_path), first)  # the code is not in the name
    assert "Inner.forward changed since" in said()
