"""Four techniques through one hole: each a ``Split`` or ``Learning`` subclass written as
a user would write it, each with the control that shows it is real (the CU14 table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import Body, Head, Pre, batches
from oracle import same
from torch import nn

from somatize import Graph, Learning, NoGradient
from somatize.torch import Split, Trainer, parameters


def sgd(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr)


# -- split learning: activations out, gradients back ---------------------------------------

class Detached(Head):
    """A head that hands nothing back: it reads its input detached."""

    def forward(self, x, ctx):
        return super().forward(x.detach(), ctx)


@pytest.mark.parametrize("head, moves", [(Head, True), (Detached, False)])
def test_split_learning_moves_the_far_half_only_when_gradients_come_back(head, moves):
    torch.manual_seed(0)
    g = Graph.somatize(Body(seed=None) >> head(seed=None).named("head"))
    trains = {"body": Split(sgd)}
    t = Trainer(g, F.cross_entropy, sgd(parameters(g, without=trains)), trains=trains)
    before = t.state_dict()["nodes"]
    t.fit(batches(3), progress=False)
    after = t.state_dict()["nodes"]
    assert same(before["body"], after["body"]) is not moves  # the control: left where it was
    assert not same(before["head"], after["head"])  # the head trains either way


# -- local greedy: nothing crosses ----------------------------------------------------------

class Greedy(Learning):
    """Trains its node on a local loss (reconstruct the input); hands nothing back."""

    def __init__(self, lr=0.05):
        self.lr = lr
        self.losses = []

    def enter(self, x, ctx):
        self.x = x.detach()
        return self.x

    def leave(self, y, ctx):
        if not hasattr(self, "decoder"):
            self.decoder = nn.Linear(y.shape[1], self.x.shape[1])
            self.opt = torch.optim.SGD([*self.node.parameters(), *self.decoder.parameters()],
                                       lr=self.lr)
        loss = F.mse_loss(self.decoder(y), self.x)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())
        return y.detach()


def test_local_greedy_learns_on_its_own_and_what_is_above_gets_no_gradient():
    torch.manual_seed(0)
    greedy = Greedy()
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    t = Trainer(g, F.cross_entropy, sgd(parameters(g, without=["body"])),
                trains={"body": greedy})
    t.fit(batches(1) * 30, progress=False)
    assert greedy.losses[-1] < 0.8 * greedy.losses[0]
    # the control: with something trained above it, that something is an orphan
    above = Graph.somatize(Pre() >> Body(seed=None) >> Head(seed=None))
    t = Trainer(above, F.cross_entropy, sgd(parameters(above, without=["body"])),
                trains={"body": Greedy()})
    with pytest.raises(NoGradient, match=r"\['pre'\]"):
        t.step(batches(1)[0])


# -- forward-forward: nothing crosses --------------------------------------------------------

class ForwardForward(Split):
    """Raises the goodness (sum of squares) of the batch's first half (positive data) and
    lowers it on the second half (negative data), at leave time; hands nothing back."""

    threshold = 2.0

    def leave(self, y, ctx):
        goodness = (y ** 2).sum(1)
        pos, neg = goodness.chunk(2)
        loss = F.softplus(self.threshold - pos).mean() + F.softplus(neg - self.threshold).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return y.detach()

    def learn(self, signal, ctx):
        return None


def separation(body, x):
    with torch.no_grad():
        pos, neg = (body.lin(x).relu() ** 2).sum(1).chunk(2)
    return (pos.mean() - neg.mean()).item()


def positive_and_negative(n=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = torch.randn(16, 8, generator=gen)
        pos = torch.cat([a[:, :4], torch.zeros(16, 4)], 1)
        neg = torch.cat([torch.zeros(16, 4), a[:, 4:]], 1)  # same statistics, other place
        out.append((torch.cat([pos, neg]), torch.cat([torch.ones(16), torch.zeros(16)]).long()))
    return out


@pytest.mark.parametrize("lr", [0.1, 0.0])
def test_forward_forward_separates_positive_from_negative_only_with_a_rate(lr):
    torch.manual_seed(0)
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    data = positive_and_negative()
    probe = positive_and_negative(1, seed=1)[0][0]  # data it was not trained on
    start = separation(g["body"], probe)
    t = Trainer(g, F.cross_entropy, sgd(parameters(g, without=["body"])),
                trains={"body": ForwardForward(torch.optim.SGD, lr=lr)})
    t.fit(data * 4, progress=False)
    end = separation(g["body"], probe)
    if lr:
        assert end > start + 2.0
    else:
        assert end == start  # the control: at rate zero, nothing separates


# -- synthetic gradients: nothing crosses ------------------------------------------------------

class Synthetic(Split):
    """Updates its node at once with a guessed gradient ĝ = M(y); when the true one
    arrives it trains M on it and records ‖ĝ − g‖ / ‖g‖; hands nothing back."""

    def __init__(self, guesser_lr):
        super().__init__(torch.optim.SGD, lr=0.05)
        self.guesser = nn.Linear(6, 6)
        nn.init.zeros_(self.guesser.weight)
        nn.init.zeros_(self.guesser.bias)
        self.guesser_opt = torch.optim.SGD(self.guesser.parameters(), lr=guesser_lr)
        self.errors = []

    def leave(self, y, ctx):
        self.kept = y.detach()
        with torch.no_grad():
            self.guess = self.guesser(self.kept)
        y.backward(self.guess)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return y.detach()

    def learn(self, signal, ctx):
        self.errors.append(((self.guess - signal).norm() / signal.norm()).item())
        loss = (self.guesser(self.kept) - signal).pow(2).sum() / signal.pow(2).sum()
        loss.backward()
        self.guesser_opt.step()
        self.guesser_opt.zero_grad()
        return None


@pytest.mark.parametrize("guesser_lr", [3e-4, 0.0])
def test_synthetic_gradients_get_closer_and_a_frozen_guesser_is_exactly_1_every_step(guesser_lr):
    torch.manual_seed(0)
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    trainer = Synthetic(guesser_lr)
    t = Trainer(g, F.cross_entropy, sgd(parameters(g, without=["body"]), lr=0.01),
                trains={"body": trainer})
    t.fit(batches(1) * 20, progress=False)
    if guesser_lr:
        assert trainer.errors[0] == 1.0 and trainer.errors[-1] < 0.85  # it gets closer
    else:
        assert trainer.errors == [1.0] * 20  # the control
