"""One step, one set of refusals: what the Trainer refuses, SomatizeStrategy refuses
before the first batch, in the Trainer's words (both drive somatize.torch's Step)."""

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

from examples.digits import DigitsData
from examples.digits_graph import Body, Head
from somatize import Done, Graph, Node, Opaque, Refused
from somatize.lightning import SomatizeStrategy
from somatize.torch import GraphModule, Split, Trainer


class Join(Node):
    """Adds what its producers hand it (a fan-in)."""

    def forward(self, x, ctx):
        return Done(Opaque(sum(x.values())))


def frozen_and_trained():
    return Graph.somatize(Body().at("worker").frozen() >> Head()), ["body"]


def two_producers():
    return Graph.somatize((Body().named("a") | Body().named("b"))
                          >> Body(10).named("body").at("worker") >> Head(10)), ["body"]


def cached_after_a_cut():
    enc = Body().named("enc").at("worker").frozen()
    kept = Head(32).named("kept").frozen().cached()
    return Graph.somatize(((enc >> kept) | Body(10).named("body").at("worker")) >> Join()
                          ), ["body"]


def naming_a_missing_node():
    return Graph.somatize(Body().at("worker") >> Head()), ["bodyy"]


class Model(pl.LightningModule):
    def __init__(self, graph):
        super().__init__()
        self.net = GraphModule(graph)

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.net.parameters() if p.requires_grad], lr=0.1)


class Batches(pl.Callback):
    def __init__(self):
        self.seen = 0

    def on_train_batch_start(self, *a):
        self.seen += 1


@pytest.mark.parametrize("case", [frozen_and_trained, two_producers, cached_after_a_cut,
                                  naming_a_missing_node])
def test_what_the_trainer_refuses_the_strategy_refuses_before_the_first_batch_in_its_words(
        case):
    graph, trained = case()
    with pytest.raises(Refused) as by_trainer:
        Trainer(graph, F.cross_entropy, trains={n: Split(torch.optim.SGD, lr=0.1)
                                                 for n in trained})
    graph, trained = case()
    batches = Batches()
    with pytest.raises(Refused) as by_strategy:
        pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False,
                   callbacks=[batches],
                   strategy=SomatizeStrategy(trains={n: Split(torch.optim.SGD, lr=0.1)
                                                     for n in trained}),
                   ).fit(Model(graph), DigitsData(limit=64))
    assert str(by_strategy.value) == str(by_trainer.value)
    assert batches.seen == 0
