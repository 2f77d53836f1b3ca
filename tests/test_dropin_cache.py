"""``SomatizeCache(store, modules=["body"])`` on a plain LightningModule: the body frozen,
its outputs kept and read back, here (in this process) and on the worker it is placed on
(tests/cache_runs.py, in its own process: RPC starts once per process), against plain
Lightning with the body frozen by hand, bit for bit."""

import csv

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.rpc as rpc
from cache_runs import fit
from lightning.pytorch.loggers import CSVLogger
from scenario import scenario

from examples.digits import DigitsData, DigitsModel
from somatize import Refused
from somatize.lightning import SomatizeCache, SomatizeStrategy
from somatize.store import Store
from somatize.torch.cache._cached import CachedForward


class BodyComputes(pl.Callback):
    """How often the body's own layers ran in each training epoch (not on a hit)."""

    def __init__(self):
        self.per_epoch = []

    def on_train_epoch_start(self, trainer, pl_module):
        if not self.per_epoch:
            pl_module.body[0].register_forward_hook(self.ran)
        self.per_epoch.append(0)

    def ran(self, *_):
        self.per_epoch[-1] += 1


def test_a_cached_body_gives_the_numbers_of_a_frozen_one_and_does_not_run_in_epoch_2(tmp_path):
    _, plain_losses, plain = fit(frozen_by_hand=True)
    cache, computes = SomatizeCache(tmp_path / "store", modules=["body"]), BodyComputes()
    _, losses, weights = fit(callbacks=[cache, computes], enable_checkpointing=True,
                             default_root_dir=tmp_path, logger=CSVLogger(tmp_path, name="csv"))
    assert losses == plain_losses and len(losses) == 4
    assert weights.keys() == plain.keys()
    assert all(torch.equal(weights[k], plain[k]) for k in plain)
    # two training batches and one validation batch an epoch: computed once, then read
    assert computes.per_epoch == [3, 0]
    assert (cache.hits, cache.misses) == (3, 3)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    # training and validation each in their own names
    assert [(float(r["cache/hits"]), float(r["cache/misses"])) for r in rows
            if r.get("cache/hits")] == [(0, 2), (2, 0)]
    assert [(float(r["cache/val_hits"]), float(r["cache/val_misses"])) for r in rows
            if r.get("cache/val_hits")] == [(0, 1), (1, 0)]
    ckpt = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=False)
    assert ckpt["callbacks"]["SomatizeCache"]["hits"] == 3
    assert ckpt["callbacks"]["SomatizeCache"]["misses"] == 3
    assert "forward" not in DigitsModel().body.__dict__  # nothing left behind on the class


def test_a_cached_body_placed_on_a_worker_is_kept_and_counted_over_there(tmp_path):
    out = tmp_path / "placed.pt"
    scenario("cache_runs.py", "placed", out, tmp_path / "store", timeout=300)
    got = torch.load(out, weights_only=False)
    (plain_losses, plain), (losses, weights) = got["plain"], got["cached"]
    assert losses == plain_losses
    assert all(torch.equal(weights[k], plain[k]) for k in plain)
    assert got["counts"] == (3, 3)  # read from the worker, at each epoch's end
    assert got["here"] == {"body": (0, 0)}  # the copy here never answered a call
    assert got["pid"] not in got["ran"]["body"] and sum(got["ran"]["body"].values()) == 6
    assert len(list((tmp_path / "store" / "names" / "value").iterdir())) == 3


def test_weights_loaded_into_a_cached_module_give_its_outputs_a_new_name(tmp_path):
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    body.forward = cached = CachedForward(body, "body", str(tmp_path))
    x = torch.rand(2, 4)
    first = body(x)
    assert torch.equal(body(x), first) and (cached.hits, cached.misses) == (1, 1)
    other = torch.nn.Linear(4, 3)
    body.load_state_dict({"0.weight": other.weight, "0.bias": other.bias})
    again = body(x)
    assert (cached.hits, cached.misses) == (1, 2)  # not the old weights' output
    assert torch.equal(again, other(x).relu())


# -- refused, saying what and what to do; nothing starts a worker -------------------------

class TrainsAll(DigitsModel):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)  # the frozen body's weights too


def trainer(**kw):
    return pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0, **kw)


class Batches(pl.Callback):
    def __init__(self):
        self.seen = 0

    def on_train_batch_start(self, *a):
        self.seen += 1


def test_caching_a_module_an_optimizer_trains_is_refused_before_the_first_batch(tmp_path):
    batches = Batches()
    with pytest.raises(Refused, match=r"optimizer 0 \(SGD\) holds its parameter body.0.weight.*"
                                      r"p.requires_grad"):
        trainer(callbacks=[SomatizeCache(tmp_path, modules=["body"]), batches]).fit(
            TrainsAll(), DigitsData(limit=64))
    assert batches.seen == 0


def test_caching_a_module_fed_by_one_that_trains_is_refused_at_its_first_call(tmp_path):
    model = DigitsModel()
    with pytest.raises(Refused, match="module 'head' is cached, but its input asks for a "
                                      "gradient.*leave 'head' out"):
        trainer(callbacks=[SomatizeCache(tmp_path, modules=["head"])]).fit(
            model, DigitsData(limit=64))
    assert not list(tmp_path.rglob("value/*"))  # nothing kept
    # and the model is its own again after the failed fit: the head's class forward runs
    assert "forward" not in model.head.__dict__
    model.head(torch.rand(2, 32, requires_grad=True)).sum().backward()


def test_caching_a_missing_module_or_a_placed_one_in_a_keeper_object_is_refused(tmp_path):
    from somatize.remote._group import group

    agent, peers = rpc.api._is_current_rpc_agent_set(), set(group().peers)  # (other tests')
    with pytest.raises(Refused, match=r"no submodule 'bodyy'; its submodules include \['body'"):
        trainer(callbacks=[SomatizeCache(tmp_path, modules=["bodyy"])]).fit(
            DigitsModel(), DigitsData(limit=64))
    with pytest.raises(Refused, match="placed on worker 'worker'.*a directory path"):
        trainer(strategy=SomatizeStrategy(place={"body": "worker"}),
                callbacks=[SomatizeCache(Store(tmp_path), modules=["body"])]).fit(
            DigitsModel(), DigitsData(limit=64))
    # refused before any worker started (in this process, other tests may have run some)
    assert rpc.api._is_current_rpc_agent_set() == agent and set(group().peers) == peers
