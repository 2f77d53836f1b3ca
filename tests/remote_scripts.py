"""Coordinators for the reliability tests, one function each. Each runs in a process of
its own (RPC starts once per process) and says what it saw on stdout, one JSON object a
line, for the test to read.

    python -c "import remote_scripts; remote_scripts.lost_worker()"
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch
from models import Body, Head, Holding, Nap, Sleepy, same
from torch.nn.functional import cross_entropy

from somatize import Graph, SomatizeError
from somatize._learning import COMPUTES, IN, Position
from somatize._node import kind_of
from somatize.remote import Worker, runtime_for
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


def _kill_when_written(path: str) -> None:
    def kill():
        for _ in range(3000):
            if os.path.exists(path):
                os.kill(int(open(path).read()), signal.SIGKILL)
                return
            time.sleep(0.01)

    threading.Thread(target=kill, daemon=True).start()


def lost_worker() -> None:
    """A worker killed in the middle of a call: that call, and every later call to it
    (a forward, a call, a provision), raises WorkerError naming it; a close and a new
    run start afresh."""
    _kill_when_written("pid.txt")
    g = Graph.somatize(Body().at("gpu") >> Sleepy("pid.txt", 60).at("gpu") >> Head())
    say(during=error_of(lambda: g.forward(x(), workers={"gpu": Worker.embedded(timeout=30)})))
    say(forward=error_of(lambda: g.forward(x())))
    say(call=error_of(lambda: runtime_for(g).call("gpu", lambda live: 1)))
    say(provision=error_of(lambda: g.provision()))
    say(pid=int(open("pid.txt").read()))
    g.close()
    with Graph.somatize(Body().at("gpu") >> Head()) as g2:
        say(again=torch.equal(g2.forward(x()), Graph.somatize(Body() >> Head()).forward(x())))


def lost_while_idle() -> None:
    """A worker killed between two runs: the next forwards raise WorkerError naming it."""
    g = Graph.somatize(Body().at("gpu") >> Head())
    g.forward(x())
    pid = runtime_for(g).peers["gpu"].pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    say(first=error_of(lambda: g.forward(x())), second=error_of(lambda: g.forward(x())),
        pid=pid)
    g.close()


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


def interrupted(where: str, path: str) -> None:
    """Run until interrupted: a remote node sleeps 60 s (writing its worker's pid to
    ``path``) under a plain forward (``where="forward"``), a fit (``"fit"``), or beside a
    node sleeping here (``"here"``)."""
    # started in the background, a process inherits SIGINT ignored: be a terminal's process
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if where == "forward":
        Graph.somatize(Body().at("gpu") >> Sleepy(path, 60).at("gpu") >> Head()).forward(x())
    elif where == "here":
        Graph.somatize(Sleepy(path, 60).at("gpu") | Nap(60)).forward(x())
    else:
        # interrupted in its second step, when the first one's gradient is owed over there
        g = Graph.somatize(Body().at("gpu") >> Sleepy(path, 60, skip=1).at("gpu") >> Head())
        trains = {"body": Split(torch.optim.SGD, lr=0.1)}
        data = [(x(), torch.tensor([0, 1, 2, 0, 1]))] * 3
        with Trainer(g, cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                     trains=trains) as t:
            t.fit(data, progress=False)
    raise SystemExit("never interrupted")
