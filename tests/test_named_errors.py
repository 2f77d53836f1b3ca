"""A wrong argument is a SomatizeError that says what was expected, never a bare
TypeError from deep inside; and a deep composition is legitimate input, not a
RecursionError. Nothing here starts a worker: each refusal comes first."""

from __future__ import annotations

import pytest
import torch
from models import Body, Head, Scale
from torch.nn import functional as F

from somatize import Graph, GraphError, MissingInput, SomatizeError, WorkerError
from somatize.remote._group import group
from somatize.torch import Split, Trainer, parameters

x = torch.randn(4, 8)
target = torch.tensor([0, 1, 2, 0])


def test_workers_that_is_not_a_dict_says_what_to_give():
    import torch.distributed.rpc as rpc

    agent, peers = rpc.api._is_current_rpc_agent_set(), set(group().peers)  # (other tests')
    g = Graph.somatize(Body().at("gpu") >> Head())
    with pytest.raises(WorkerError, match=r"workers= takes a dict \{host: Worker\}, not a int"):
        g.forward(x, workers=42)
    with pytest.raises(WorkerError, match=r"workers= takes a dict"):
        Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g), lr=0.1), workers=42)
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    with pytest.raises(WorkerError, match=r"workers= takes a dict"):
        Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                trains=trains, workers=42)
    with pytest.raises(WorkerError, match=r"workers\['gpu'\] is a int: give a Worker"):
        g.forward(x, workers={"gpu": 42})
    # the same words from every door: the Session, the runtime, the staged Step
    from somatize.remote._runtime import runtime_for
    from somatize.torch._session import Session
    from somatize.torch.graph._step import Step

    for door in (lambda: Session(workers=[1]), lambda: runtime_for(g, [1]),
                 lambda: Step(g, workers=[1])):
        with pytest.raises(WorkerError, match=r"workers= takes a dict \{host: Worker\}, not "
                                              r"a list: e\.g\. workers=\{'gpu'"):
            door()
    # refused before any process was started
    assert rpc.api._is_current_rpc_agent_set() == agent and set(group().peers) == peers
    g.close()


def test_feeds_that_is_not_a_dict_names_the_roots():
    g = Graph.somatize(Body() >> Head())
    with pytest.raises(MissingInput, match=r"feeds= takes a dict \{root_id: value\}, not a int; "
                                           r"the graph's roots are \['body'\]"):
        g.forward(feeds=42)


def test_a_salt_that_is_not_a_string_says_what_a_salt_is():
    with pytest.raises(GraphError, match=r"Body.cached\(salt=<object .*>\): a salt is a string"):
        Body().cached(salt=object())


@pytest.mark.parametrize("batch", [x, (x,), (x, target, target)],
                         ids=["a bare tensor", "a 1-tuple", "a triple"])
def test_data_yielding_something_else_than_pairs_says_so(batch):
    g = Graph.somatize(Body() >> Head())
    t = Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g), lr=0.1))
    with pytest.raises(SomatizeError, match=r"takes a batch \(input, target\); got a "):
        t.fit([batch], progress=False)


@pytest.mark.parametrize("objective, what", [
    (lambda y, t: F.cross_entropy(y, t, reduction="none"), "a tensor of shape (4,)"),
    (lambda y, t: 0.5, "a float"),
], ids=["a tensor per sample", "a float"])
def test_an_objective_that_does_not_return_a_scalar_loss_says_so(objective, what):
    g = Graph.somatize(Body() >> Head())
    t = Trainer(g, objective, torch.optim.SGD(parameters(g), lr=0.1))
    with pytest.raises(SomatizeError) as e:
        t.step((x, target))
    assert f"the objective returned {what}, not a scalar loss" in str(e.value)
    assert ".mean()" in str(e.value)


def test_a_composition_nested_thousands_deep_builds_describes_and_runs():
    # a >> (b | (c >> (d | ...))): 3000 levels, three times Python's recursion limit
    expr = Scale(2)
    for i in range(3000):
        expr = (Scale(2) >> expr) if i % 2 else (Scale(2) | expr)
    g = Graph.somatize(expr)
    assert len(g.ids) == 3001 and len(g.sinks) == 1501
    assert len(g.plan.waves) == 1501
    lines = g.describe().splitlines()
    assert len(lines) == 1 + 3001 + 2 and lines[1].split()[:2] == ["0", "scale"]
    out = g.forward(1)
    # the innermost node sits under the 1500 in sequence above it: 2 ** 1501, as ints keep it
    assert out["scale_3001"] == 2 ** 1501 and out["scale_2"] == 4
