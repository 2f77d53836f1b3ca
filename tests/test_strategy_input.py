"""What a user gets wrong in place= and workers= (in Python or on the Hydra line) is
refused in one line that names the cause and the fix, before any worker starts; a
workers= name that no placement uses (a typo) is refused with the near name beside it,
instead of training on an embedded worker without a word."""

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from test_hydra import config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from somatize import Refused
from somatize.lightning import SomatizeStrategy


@pytest.mark.parametrize("kw, says", [
    ({"place": ["body"]}, "place= takes a dict {submodule path: worker name}, not a list"),
    ({"place": "body"}, "place= takes a dict {submodule path: worker name}, not a str"),
    ({"place": {"body": 3}}, "place={'body': 3}: each entry is a submodule path and a worker"),
    ({"workers": ["127.0.0.1:7000"]}, "workers= takes a dict {worker name: Worker}, not a list"),
    ({"workers": {"worker": 12345}}, "workers={'worker': 12345}: each entry is a worker name "
                                     "and a Worker or its address 'host:port'"),
    ({"workers": {"worker": "node3"}}, "Worker.at('node3'): give the daemon's address as "
                                       "'host:port'"),
])
def test_a_wrong_type_in_place_or_workers_is_one_line_naming_the_cause_and_the_fix(kw, says):
    with pytest.raises(Exception) as got:
        SomatizeStrategy(**kw)
    said = str(got.value)
    assert said.startswith(says) and "\n" not in said, said


def test_a_bare_name_for_somatize_place_on_the_hydra_line_is_refused_with_the_dict_form():
    with pytest.raises(Exception) as got:
        instantiate(config("+somatize=split", "somatize.place=body").trainer.strategy)
    assert "'somatize.place={body: worker}'" in str(got.value), got.value


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.body(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_workers_name_no_placement_uses_is_refused_with_the_near_name_beside_it():
    strategy = SomatizeStrategy(place={"body": "gpu"}, workers={"gpu0": "127.0.0.1:9"})
    trainer = pl.Trainer(strategy=strategy, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), 4)
    with pytest.raises(Refused) as got:
        trainer.fit(Model(), data)
    assert str(got.value).startswith(
        "workers= names 'gpu0' (placement 'gpu'?), which no placement uses (placed on: "
        "'gpu')"), got.value
