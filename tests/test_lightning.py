"""GraphModule and SomatizeCache with a real lightning.Trainer, in this process (no RPC),
and the strategy's refusals at setup."""

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from examples.digits import DigitsData
from examples.digits_graph import DigitsGraphModel, digits_graph
from somatize import Refused
from somatize.lightning import SomatizeCache, SomatizeStrategy
from somatize.torch import GraphModule


def trainer(**kw):
    return pl.Trainer(enable_progress_bar=False, enable_model_summary=False,
                      **{"logger": False, "max_epochs": 1, "limit_val_batches": 1, **kw})


def test_graph_module_runs_every_node_here_and_holds_their_weights():
    torch.manual_seed(0)
    g = digits_graph(body_at="far-away")
    gm = GraphModule(g)
    assert sorted(gm.state_dict()) == ["nodes.body.lin.bias", "nodes.body.lin.weight",
                                       "nodes.head.lin.bias", "nodes.head.lin.weight"]
    x = torch.rand(3, 64)
    expected = g["head"].lin(g["body"].lin(x).relu())
    assert torch.equal(gm(x), expected)
    assert gm.to(torch.float64).nodes["body"].lin.weight is g["body"].lin.weight


def test_frozen_nodes_stay_in_eval_mode_when_lightning_calls_train():
    gm = GraphModule(digits_graph(frozen=True))
    gm.train()
    assert not gm.nodes["body"].training and gm.nodes["head"].training


def test_bf16_mixed_precision_is_refused_at_setup_for_nodes_a_split_trains():
    with pytest.raises(Refused, match="precision='32-true'.*place="):
        trainer(precision="bf16-mixed", strategy=SomatizeStrategy()).fit(
            DigitsGraphModel(), DigitsData(limit=64))


def test_gradient_clipping_is_refused_at_setup_it_would_miss_the_split_trained_weights():
    with pytest.raises(Refused, match="gradient_clip_val with a GraphModule's nodes trained on "
                                      "workers.*weights here only"):
        trainer(gradient_clip_val=1.0, strategy=SomatizeStrategy()).fit(
            DigitsGraphModel(), DigitsData(limit=64))


def test_trains_naming_a_node_not_there_or_one_that_runs_here_is_refused_at_setup():
    from somatize.torch import Split

    with pytest.raises(Refused, match=r"trains names \['bodyy'\], which are not in the graph.*"
                                      r"'body'"):
        trainer(strategy=SomatizeStrategy(trains={"bodyy": Split(torch.optim.SGD, lr=0.1)})
                ).fit(DigitsGraphModel(), DigitsData(limit=64))
    with pytest.raises(Refused, match="trains names 'head', which runs here"):
        trainer(strategy=SomatizeStrategy(trains={"head": Split(torch.optim.SGD, lr=0.1)})
                ).fit(DigitsGraphModel(), DigitsData(limit=64))


def test_the_strategy_is_registered_by_name():
    assert isinstance(trainer(strategy="somatize").strategy, SomatizeStrategy)


def test_a_cache_the_prefix_rule_forbids_is_refused_before_the_first_batch(tmp_path):
    seen = []

    class Batches(pl.Callback):
        def on_train_batch_start(self, *a):
            seen.append(1)

    with pytest.raises(Refused, match="'body' is .cached"):
        trainer(callbacks=[SomatizeCache(tmp_path), Batches()]).fit(
            DigitsGraphModel(cached=True), DigitsData(limit=64))
    assert seen == []


def test_the_cache_settles_the_body_keeps_its_outputs_and_its_counts_in_checkpoints(tmp_path):
    pl.seed_everything(0)
    model = DigitsGraphModel(frozen=True, cached=True)
    body = model.net.nodes["body"].lin.weight.clone()
    cache = SomatizeCache(tmp_path / "store")
    t = trainer(max_epochs=2, callbacks=[cache], default_root_dir=tmp_path,
                enable_checkpointing=True, logger=CSVLogger(tmp_path, name="csv"))
    t.fit(model, DigitsData(limit=64, shuffle=False))
    assert torch.equal(model.net.nodes["body"].lin.weight, body)  # frozen: never trained
    assert cache.misses > 0 and cache.hits >= cache.misses  # epoch 2 found epoch 1's
    # reported to the logger once an epoch, adding up to the totals; the second computed none
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    by_epoch = [(float(r["cache/hits"]), float(r["cache/misses"])) for r in rows
                if r.get("cache/hits")]
    val = [(float(r["cache/val_hits"]), float(r["cache/val_misses"])) for r in rows
           if r.get("cache/val_hits")]
    assert len(by_epoch) == 2 and by_epoch[1][1] == 0.0, by_epoch
    assert len(val) == 2 and val[1][1] == 0.0, val  # validation in its own names
    assert [sum(c) for c in zip(*by_epoch, *val, strict=True)] == [cache.hits, cache.misses]
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt"), None) or next(
        tmp_path.rglob("*.ckpt"))
    state = torch.load(ckpt, weights_only=False)["callbacks"]["SomatizeCache"]
    assert (state["hits"], state["misses"]) == (cache.hits, cache.misses)
