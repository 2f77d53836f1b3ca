"""Coordinators for tests/test_remote_reliability.py and tests/test_remote_failure.py:
workers lost, killed, interrupted, too slow, or raising, one function each. Each runs in
a process of its own (RPC starts once per process), as this script's ``__main__``, so a
class defined here travels by value, as a user's script's would, and those of ``models``
by reference. Each asserts what it can see itself and says the rest on stdout for the
test to read: the reliability ones one JSON object a line.

    python tests/remote_failure_runs.py lost_worker
    python tests/remote_failure_runs.py interrupted forward /tmp/pid.txt
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from models import Body, Boom, Head, Holding, Nap, Sleepy
from oracle import same
from remote_common import _kill_when_written, error_of, say, worker_error, x
from torch.nn.functional import cross_entropy

from somatize import Graph
from somatize._learning import COMPUTES, IN, Position
from somatize._node import kind_of
from somatize.remote import Worker, runtime_for
from somatize.torch import Split, Trainer, parameters


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
            there=b.runtime.call("gpu", _over_there))


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


def boom_over_there() -> None:
    """An exception in a node over there is raised here as its own type (a ValueError),
    naming the worker and the node, the worker's traceback as its cause."""
    xs = x()
    with Graph.somatize(Body().at("gpu") >> Boom().at("gpu") >> Head()) as g:
        try:
            g.forward(xs)
        except ValueError as e:
            msg, cause = str(e), str(e.__cause__)
        else:
            raise SystemExit("no error")
    assert msg.startswith("boom inside the node (raised in node 'boom' on worker 'gpu'"), msg
    assert "Traceback" in cause and 'raise ValueError("boom inside the node")' in cause, cause


def too_long() -> None:
    """A call that takes too long fails within the timeout (3 s), not the 30 s sleep."""
    xs = x()
    g = Graph.somatize(Sleepy("pid.txt", 30).at("gpu"))
    msg, took = worker_error(g, xs, workers={"gpu": Worker.embedded(timeout=3)})
    assert "'gpu'" in msg and "sleepy" in msg and "3 s" in msg, msg
    assert took < 25, took  # bounded by the timeout, not by the 30 s sleep
    g.close()


def killed_mid_run() -> None:
    """A worker killed in the middle of a run: a clear error within the timeout; prints
    its pid and the message; a later run in the same process still gets a worker."""
    xs = x()
    _kill_when_written("pid.txt")
    g = Graph.somatize(Body().at("gpu") >> Sleepy("pid.txt", 60).at("gpu") >> Head())
    msg, took = worker_error(g, xs, workers={"gpu": Worker.embedded(timeout=30)})
    assert took < 30, "it waited for the timeout, or longer"
    assert "'gpu'" in msg and "sleepy" in msg, msg
    print("PID", open("pid.txt").read())
    g.close()
    g.close()
    # a later run in the same process still gets a worker
    with Graph.somatize(Body().at("gpu") >> Head()) as g2:
        assert torch.equal(g2.forward(xs), Graph.somatize(Body() >> Head()).forward(xs))
    print("MSG", msg)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
