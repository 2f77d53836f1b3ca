"""The learning hole and the trainer that ships: one object in two positions, built at
first use, surviving pickling, and the envelope a gradient travels in."""

from __future__ import annotations

import functools
import pickle

import torch
import torch.nn.functional as F
from models import Body, Head, batches, twins
from oracle import same, weights

import somatize
from somatize import Ctx, Done, Graph, Node, Opaque, stages
from somatize._learning import COMPUTES, IN, Envelope, Position, around, is_envelope
from somatize.torch import Split, Trainer, parameters


def test_learning_is_the_hole_with_three_hooks_that_change_nothing_by_default():
    hole = somatize.Learning()
    ctx = Ctx("body")
    assert hole.enter(3, ctx) == 3 and hole.leave(4, ctx) == 4 and hole.learn(5, ctx) is None


def test_a_gradient_riding_with_an_input_is_told_apart_by_its_envelope_and_nothing_else():
    g, x = torch.ones(2), torch.zeros(3)
    assert is_envelope(Envelope(g, x)) and is_envelope(Envelope(None, x))
    lookalike = type("Envelope", (), {"signal": g, "then": x})()  # same name and fields
    assert not any(is_envelope(v) for v in (g, {"signal": g}, lookalike,
                                            Opaque(Envelope(g, x))))
    assert Envelope(None, x).signal is None  # "no gradient for you this step"
    back = pickle.loads(pickle.dumps(Envelope(g, Opaque(x))))
    assert is_envelope(back) and torch.equal(back.signal, g) and torch.equal(back.then.value, x)


def test_split_stands_in_two_positions_and_nobody_downstream_is_told():
    class Both(Node):
        def forward(self, x, ctx):
            return Done(sorted(x))  # the fan-in dict, keyed by the producers' ids

    g = Graph.somatize((Body(seed=None) | Head(None, 8)) >> Both())
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    a = around(g, trains)
    before, inside = Position("body", IN), Position("body", COMPUTES)
    assert a[before] is a["body"] is trains["body"] and a[inside] is g["body"]
    assert a.preds["both"] == g.preds["both"] == ("body", "head")
    assert a.forward(torch.randn(2, 8), training=True) == ["body", "head"]
    assert stages(g, trains) == [{"body", "head"}, {"both"}]  # the user's ids only


def test_split_builds_its_optimizer_at_first_use_from_a_factory_that_pickles():
    built = []

    class Counted(torch.optim.SGD):
        def __init__(self, *args, **kw):
            built.append(1)
            super().__init__(*args, **kw)

    counted = Split(Counted, lr=0.1)
    assert built == []  # never in __init__
    counted.node = Body(seed=None)
    assert counted.optimizer is counted.optimizer and built == [1]  # at first use, once
    s = Split(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert isinstance(s.factory, functools.partial) and pickle.loads(pickle.dumps(s.factory))
    body = Body(seed=None)
    s.node = body
    assert s.optimizer.param_groups[0]["params"][0] is body.lin.weight
    assert s.optimizer.defaults["momentum"] == 0.9


def test_a_pickled_trained_graph_keeps_one_object_in_two_positions_and_trains_after_it():
    whole, split = twins(lambda: Body(seed=None) >> Head(seed=None))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    t = Trainer(split, F.cross_entropy, torch.optim.SGD(parameters(split, without=trains),
                                                        lr=0.1), trains=trains)
    t.step(batches(1)[0])  # the optimizer exists now, and travels with the catalog
    live = pickle.loads(pickle.dumps(around(split, trains)))
    before, inside = Position("body", IN), Position("body", COMPUTES)
    assert live[before] is live["body"]
    assert live["body"].node is live[inside]
    assert live["body"].optimizer.param_groups[0]["params"][0] is live[inside].lin.weight
    # the rebuilt trainer learns: forward through both positions, then a gradient back
    x, _ = batches(1, seed=1)[0]
    y = live.forward(x, training=True)  # the head's output; body kept its activation
    was = weights(live)[inside]
    assert live["body"].learn(torch.ones(16, 6), Ctx("body", None, True)) is None  # a root
    assert y.shape == (16, 3) and not same(was, weights(live)[inside])


def test_learn_receives_dl_dy_and_gives_back_dl_dx():
    body = Body(seed=None)
    s = Split(torch.optim.SGD, lr=0.0)
    s.node = body
    s.feeds_back = True
    x = torch.randn(4, 8)
    ctx = Ctx("body", None, True)
    y = body.forward(s.enter(x, ctx), ctx).value.value
    s.leave(y, ctx)
    signal = torch.randn(4, 6)
    want = torch.autograd.grad(body.lin(x.requires_grad_()).relu(), x, signal)[0]
    assert torch.equal(s.learn(signal, ctx), want)


def test_an_envelope_carrying_nothing_leaves_the_weights_where_they_were():
    body = Body(seed=None)
    s = Split(torch.optim.SGD, lr=0.1)
    s.node = body
    before = [p.detach().clone() for p in body.parameters()]
    ctx = Ctx("body", None, True)
    s.leave(body.forward(s.enter(torch.randn(4, 8), ctx), ctx).value.value, ctx)
    assert s.learn(None, ctx) is None
    assert same(before, [p.detach() for p in body.parameters()])


def test_a_trained_node_sees_its_own_id_in_ctx_not_its_position():
    seen = []

    class Watched(Body):
        def forward(self, x, ctx):
            seen.append(ctx.node)
            return super().forward(x, ctx)

    g = Graph.somatize(Watched(seed=None).named("body") >> Head(seed=None))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=0.1),
            trains=trains).step(batches(1)[0])
    assert seen == ["body"]


def test_an_accumulating_split_learns_twice_and_steps_once_on_the_summed_gradient():
    torch.manual_seed(0)
    body = Body(seed=None)
    oracle = Body(seed=None)
    oracle.lin.load_state_dict(body.lin.state_dict())
    s = Split(torch.optim.SGD, lr=0.1, momentum=0.9)
    s.node, s.accumulates = body, True
    ctx = Ctx("body", None, True)
    xs, signals = torch.randn(2, 4, 8), torch.randn(2, 4, 6)
    for x, signal in zip(xs, signals, strict=True):
        s.leave(body.forward(s.enter(x, ctx), ctx).value.value, ctx)
        s.learn(signal, ctx)
    assert same(weights_of(oracle), weights_of(body))  # learned, not yet applied
    s.step()
    opt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    for x, signal in zip(xs, signals, strict=True):
        torch.autograd.backward(oracle.forward(x, ctx).value.value, signal)
    opt.step()
    assert same(weights_of(oracle), weights_of(body))
    assert all(p.grad is None for p in body.parameters())  # forgotten once applied


def weights_of(node):
    return [p.detach().clone() for p in node.parameters()]
