"""Trainer.fit as a user watches it: the progress bar counts steps and ends at the total.

    Trainer(g, cross_entropy, SGD(parameters(g), lr=0.1)).fit(data, epochs=3)
"""

from __future__ import annotations

import torch
from models import Body, Head
from torch.nn.functional import cross_entropy

from somatize import Graph
from somatize.torch import Trainer, parameters


def _fit(progress: bool) -> list[float]:
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(5)]
    g = Graph.somatize(Body() >> Head())
    t = Trainer(g, cross_entropy, torch.optim.SGD(parameters(g), lr=0.1))
    return t.fit(data, epochs=3, progress=progress)


def test_the_progress_bar_counts_every_step_and_ends_at_the_total(capsys):
    losses = _fit(progress=True)
    shown = [s for s in capsys.readouterr().err.replace("\r", "\n").splitlines() if s.strip()]
    last = shown[-1]  # what stays on the screen once the bar is closed
    assert "epoch 3/3" in last and "15/15" in last, shown
    assert f"loss={sum(losses[10:]) / 5:.4f}" in last, (last, losses)


def test_progress_false_prints_nothing_and_trains_the_same(capsys):
    quiet = _fit(progress=False)
    assert capsys.readouterr().err == ""
    assert quiet == _fit(progress=True)
