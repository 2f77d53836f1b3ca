"""Driving a training step: in one piece, or in stages when something is trained where
it runs — and bit for bit the same numbers either way (far half in this process)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from models import Body, Head, Mute, Pre, batches, twins
from oracle import same, weights
from torch import nn

from somatize import Done, Graph, Node, NoGradient, NotSettled, Opaque, Refused, stages
from somatize.torch import Split, Trainer, freeze, parameters

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def whole_and_split(build, trains, steps=10):
    """Train twin graphs, one whole and one with ``trains``; return both trainers' results."""
    whole, split = twins(build)
    data = batches(steps)
    a = Trainer(whole, F.cross_entropy, SGD(parameters(whole)))
    local = parameters(split, without=trains)
    b = Trainer(split, F.cross_entropy, SGD(local) if local else None, trains=trains)
    return a.fit(data, progress=False), b.fit(data, progress=False), a, b


def test_a_cut_graph_trains_to_the_same_numbers_as_the_whole_one_weights_included():
    trains = {"body": Split(torch.optim.SGD, lr=0.1, momentum=0.9)}
    la, lb, a, b = whole_and_split(lambda: Pre() >> Body(seed=None) >> Head(seed=None), trains)
    assert la == lb
    assert same(a.state_dict()["nodes"], b.state_dict()["nodes"])
    assert same(weights(a.graph), weights(b.graph))  # in this process, the objects themselves


def test_the_hand_written_loop_and_trainer_step_give_the_same_losses():
    mine, theirs = twins(lambda: Pre() >> Body(seed=None) >> Head(seed=None))
    pre, body, head = (mine[n].lin for n in ("pre", "body", "head"))
    opt = SGD([*pre.parameters(), *body.parameters(), *head.parameters()])
    by_hand = []
    for x, y in batches():
        loss = F.cross_entropy(head(body(pre(x).tanh()).relu()), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        by_hand.append(loss.item())
    trains = {"body": Split(torch.optim.SGD, lr=0.1, momentum=0.9)}
    t = Trainer(theirs, F.cross_entropy, SGD(parameters(theirs, without=trains)), trains=trains)
    assert [t.step(b) for b in batches()] == by_hand


def reaches(out: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd walks back from ``out`` to ``weight`` (one graph, no cut between)."""
    todo, seen = [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if getattr(fn, "variable", None) is weight:
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def seen_by_objective(outs: list):
    def objective(y, target):
        outs.append(y)
        return F.cross_entropy(y, target)
    return objective


def test_it_is_driven_in_stages_only_when_something_is_trained_where_it_runs():
    g = Graph.somatize(Pre() >> Body(seed=None) >> Head(seed=None))
    outs = []
    Trainer(g, seen_by_objective(outs), SGD(parameters(g))).step(batches(1)[0])
    assert reaches(outs[0], g["pre"].lin.weight)  # one autograd graph: no trainer anywhere
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    Trainer(g, seen_by_objective(outs), SGD(parameters(g, without=trains)),
            trains=trains).step(batches(1)[0])
    # in stages: the objective's graph stops at the trained body's output (a leaf)
    assert reaches(outs[1], g["head"].lin.weight)
    assert not reaches(outs[1], g["body"].lin.weight)
    assert not reaches(outs[1], g["pre"].lin.weight)


def test_a_lone_trained_node_is_one_stage_and_still_learns_through_its_transpose():
    g1, g2 = twins(lambda: Body(None, 8, 3))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    assert stages(g2, trains) == [{"body"}]
    la = Trainer(g1, F.cross_entropy, torch.optim.SGD(parameters(g1), lr=0.1)).fit(
        batches(5), progress=False)
    lb = Trainer(g2, F.cross_entropy, trains=trains).fit(batches(5), progress=False)
    assert la == lb and same(weights(g1), weights(g2))


def test_what_is_above_a_trained_node_gets_its_gradient_through_it_and_nobody_stands_still():
    trains = {"body": Split(torch.optim.SGD, lr=0.1, momentum=0.9)}
    before = None
    whole, split = twins(lambda: Pre() >> Body(seed=None) >> Head(seed=None))
    before = weights(split)
    t = Trainer(split, F.cross_entropy, SGD(parameters(split, without=trains)), trains=trains)
    t.fit(batches(3), progress=False)
    after = weights(split)
    for n in ("pre", "body", "head"):
        assert all(not torch.equal(x, y) for x, y in zip(before[n], after[n], strict=True)), n
    Trainer(whole, F.cross_entropy, SGD(parameters(whole))).fit(batches(3), progress=False)
    assert same(weights(whole)["pre"], after["pre"])


def test_a_graph_where_everything_is_trained_elsewhere_takes_no_optimizer_here():
    trains = {n: Split(torch.optim.SGD, lr=0.1, momentum=0.9) for n in ("pre", "body", "head")}
    la, lb, a, b = whole_and_split(lambda: Pre() >> Body(seed=None) >> Head(seed=None), trains)
    assert b.optimizer is None
    assert la == lb and same(weights(a.graph), weights(b.graph))


def test_two_trainers_side_by_side_feeding_a_fan_in_match_the_whole_net():
    class Join(Node):
        def __init__(self):
            self.lin = nn.Linear(12, 3)

        def forward(self, x, ctx):  # keyed by the trained nodes' own ids
            return Done(Opaque(self.lin(torch.cat([x["body"], x["body_2"]], 1))))

        def parameters(self):
            return list(self.lin.parameters())

    trains = {n: Split(torch.optim.SGD, lr=0.1, momentum=0.9) for n in ("body", "body_2")}
    la, lb, a, b = whole_and_split(
        lambda: Pre() >> (Body(seed=None) | Body(seed=None)) >> Join(), trains)
    assert la == lb and same(weights(a.graph), weights(b.graph))


def test_stop_and_resume_through_state_dict_reproduces_the_uninterrupted_run():
    build = lambda: Pre() >> Body(seed=None) >> Head(seed=None)  # noqa: E731
    data = batches(10)
    g1, g2 = twins(build)
    _, g3 = twins(build)

    def trainer(g):
        trains = {"body": Split(torch.optim.SGD, lr=0.1, momentum=0.9)}
        return Trainer(g, F.cross_entropy, SGD(parameters(g, without=trains)), trains=trains)

    straight = trainer(g1)
    expected = [straight.step(b) for b in data]
    first = trainer(g2)
    got = [first.step(b) for b in data[:4]]
    saved = first.state_dict()
    resumed = trainer(g3)  # fresh weights and optimizers: everything comes from `saved`
    resumed.load_state_dict(saved)
    got += [resumed.step(b) for b in data[4:]]
    assert got == expected
    assert same(resumed.state_dict(), straight.state_dict())


def test_local_parameters_with_no_gradient_raise_no_gradient_naming_them():
    class Keeps(Split):  # trains its node but hands nothing back upstream
        def learn(self, signal, ctx):
            super().learn(signal, ctx)
            return None

    g = Graph.somatize(Pre() >> Body(seed=None) >> Head(seed=None))
    trains = {"body": Keeps(torch.optim.SGD, lr=0.1)}
    t = Trainer(g, F.cross_entropy, SGD(parameters(g, without=trains)), trains=trains)
    with pytest.raises(NoGradient, match="'pre'") as e:
        t.step(batches(1)[0])
    assert "body" not in str(e.value) and "head" not in str(e.value)


# -- refused when the trainer is built, naming the nodes ---------------------------------------

def split():
    return Split(torch.optim.SGD, lr=0.1)


def test_cached_after_a_cut_is_refused():
    g = Graph.somatize(Body(seed=None) >> Pre(8 - 2).frozen().cached())
    freeze(g)
    with pytest.raises(Refused, match=r"\['pre'\].*after a cut"):
        Trainer(g, F.mse_loss, trains={"body": split()})


def test_trains_naming_somebody_who_is_not_there_is_refused():
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    with pytest.raises(Refused, match=r"\['bodyy'\].*'body', 'head'"):
        Trainer(g, F.cross_entropy, trains={"bodyy": split()})


def test_settled_and_trained_is_refused():
    g = Graph.somatize(Body(seed=None).frozen() >> Head(seed=None))
    with pytest.raises(Refused, match="'body' is declared .frozen.. and trained"):
        Trainer(g, F.cross_entropy, trains={"body": split()})


def test_a_trained_node_that_does_not_say_its_parameters_is_refused():
    g = Graph.somatize(Mute() >> Body(seed=None))
    with pytest.raises(Refused, match="'mute' .Mute. is trained but does not say"):
        Trainer(g, F.cross_entropy, trains={"mute": split()})


def test_the_same_weights_in_the_local_optimizer_and_a_trainer_are_refused():
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    with pytest.raises(Refused, match=r"holds weights of \['body'\].*without=trains"):
        Trainer(g, F.cross_entropy, SGD(parameters(g)), trains={"body": split()})


def test_a_trained_node_with_two_producers_is_refused():
    g = Graph.somatize((Body(seed=None) | Body(seed=None)) >> Pre(6))
    with pytest.raises(Refused, match=r"'pre' is trained and has two producers"
                       r" \['body', 'body_2'\]"):
        Trainer(g, F.mse_loss, trains={"pre": split()})


def test_one_trainer_object_for_two_nodes_is_refused():
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    s = split()
    with pytest.raises(Refused, match="both 'body' and 'head'"):
        Trainer(g, F.cross_entropy, trains={"body": s, "head": s})


# -- the plain path, store, fit -------------------------------------------------------------

class Encoder(Node):
    runs = 0

    def __init__(self):
        self.lin = nn.Linear(8, 8)

    def forward(self, x, ctx):
        Encoder.runs += 1
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


def test_a_store_settles_what_is_frozen_and_keeps_what_is_cached(tmp_path):
    Encoder.runs = 0
    g = Graph.somatize(Encoder().frozen().cached() >> Body(seed=None) >> Head(seed=None))
    head_here = parameters(g, without={"encoder"})
    with pytest.raises(NotSettled, match="'encoder'"):
        g.forward(batches(1)[0][0])
    t = Trainer(g, F.cross_entropy, SGD(head_here), store=tmp_path)
    g.forward(batches(1)[0][0])  # settled when the trainer was built: it runs now
    Encoder.runs = 0
    data = batches(3)
    first = t.fit(data, epochs=2, progress=False)
    assert Encoder.runs == 3  # the second epoch found every output kept
    assert first[3:] != first[:3]  # and the rest still trains
    # the same graph in stages, Body trained by a Split: the encoder is still not run again
    trains = {"body": split()}
    s = Trainer(g, F.cross_entropy, SGD(parameters(g, without=["encoder", *trains])),
                trains=trains, store=tmp_path)
    s.fit(data, progress=False)
    assert Encoder.runs == 3


def test_fit_returns_every_loss_and_with_closes(caplog):
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    with Trainer(g, F.cross_entropy, SGD(parameters(g))) as t, caplog.at_level("INFO"):
        losses = t.fit(batches(4), epochs=2, progress=False)
    assert len(losses) == 8 and all(isinstance(x, float) for x in losses)
    assert "epoch 2/2: mean loss" in caplog.text


def test_fit_shows_a_progress_bar_with_the_running_loss_and_a_flag_turns_it_off(capsys):
    g = Graph.somatize(Body(seed=None) >> Head(seed=None))
    t = Trainer(g, F.cross_entropy, SGD(parameters(g)))
    losses = t.fit(batches(3), epochs=1)
    shown = capsys.readouterr().err
    assert "epoch 1/1" in shown and f"loss={sum(losses) / 3:.4f}" in shown, shown
    t.fit(batches(3), epochs=1, progress=False)
    assert capsys.readouterr().err == ""



def test_the_objectives_own_backward_goes_on_through_the_last_stage():
    g = Graph.somatize(Pre() >> Body(seed=None) >> Head(seed=None))
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    outs = []
    t = Trainer(g, seen_by_objective(outs), SGD(parameters(g, without=trains)), trains=trains)
    t.step(batches(1)[0])
    # the head's output as the head made it (one backward call), not a leaf cut from it
    assert outs[0].grad_fn is not None and reaches(outs[0], g["head"].lin.weight)
