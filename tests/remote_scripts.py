"""Coordinators for the reliability tests, one function each. Each runs in a process of
its own (RPC starts once per process) and says what it saw on stdout, one JSON object a
line, for the test to read.

    python -c "import remote_scripts; remote_scripts.unpicklable_here()"
"""

from __future__ import annotations

import json

import torch
from models import Body, Head, Holding
from split_nodes import same
from torch.nn.functional import cross_entropy

from somatize import Graph, SomatizeError
from somatize._learning import COMPUTES, IN, Position
from somatize._node import kind_of
from somatize.torch import Split, Trainer, parameters


def say(**what) -> None:
    print(json.dumps(what), flush=True)


def x() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(5, 8)


def error_of(fn) -> dict:
    """What ``fn()`` raised: its class and message (or that it raised nothing)."""
    try:
        fn()
    except Exception as e:
        return {"error": type(e).__name__, "somatize": isinstance(e, SomatizeError),
                "message": str(e)}
    return {"error": None}


def _over_there(live) -> dict:
    # what a worker holds: its own nodes, the trainer in both positions, and for the rest
    # stand-ins (objects that are not of the kind the catalog says)
    trainer = live.catalog["body"]
    return {"one_trainer": live.catalog[Position("body", IN)] is trainer,
            "trains_its_node": trainer.node is live.catalog[Position("body", COMPUTES)],
            "elsewhere": sorted(str(n) for n, o in live.catalog.items()
                                if type(o).__name__ != kind_of(o))}


def unpicklable_here() -> None:
    """A node that does not pickle, run here, beside a node placed on a worker: the graph
    runs and trains as it would in one piece."""
    xs = x()
    local = Graph.somatize(Body() >> Head() >> Holding())
    with Graph.somatize(Body().at("gpu") >> Head() >> Holding()) as g:
        say(forward=torch.equal(g.forward(xs), local.forward(xs)))
    data = [(xs, torch.tensor([0, 1, 2, 0, 1]))] * 3
    whole = Graph.somatize(Body() >> Head() >> Holding())
    a = Trainer(whole, cross_entropy, torch.optim.SGD(parameters(whole), lr=0.1))
    far = Graph.somatize(Body().at("gpu") >> Head() >> Holding())
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    with Trainer(far, cross_entropy, torch.optim.SGD(parameters(far, without=trains), lr=0.1),
                 trains=trains) as b:
        say(losses=a.fit(data, progress=False) == b.fit(data, progress=False),
            weights=same(a.state_dict()["nodes"], b.state_dict()["nodes"]),
            there=b._step.runtime.call("gpu", _over_there))
