"""Coordinators for tests/test_remote.py: graphs with nodes on embedded workers, against one
process, one function each. Each runs in a process of its own (RPC starts once per
process), as this script's ``__main__``, so a class defined here travels by value, as a
user's script's would, and those of ``models`` by reference. Each asserts what it can see
itself and says the rest on stdout for the test to read.

    python tests/remote_graph_runs.py seeds_graph
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch
from models import Body, Head, Locked, Scale, Unlock
from remote_common import x
from torch.nn.functional import cross_entropy

from somatize import Done, Graph, Lost, Node, Opaque, Refused
from somatize.remote import Worker, runtime_for
from somatize.torch import Split, Trainer, parameters


def seeds_graph() -> None:
    """The seeds' graph with its body on an embedded worker equals one process; prints
    the worker's pid."""
    xs = x()
    here = Graph.somatize(Body() >> Head()).forward(xs)
    g = Graph.somatize(Body().at("gpu") >> Head())
    y = g.forward(xs)
    pid = runtime_for(g).peers["gpu"].pid
    y2 = g.forward(Opaque(xs))  # a second forward reuses the worker
    assert runtime_for(g).peers["gpu"].pid == pid
    assert pid != os.getpid()
    assert torch.equal(y, here) and torch.equal(y2, here), (y, here)
    g.close()
    g.close()  # idempotent
    print("PID", pid)


def loopback_only() -> None:
    """Prints the addresses the coordinator and its worker listen on, and the interface
    each side told TensorPipe."""
    from remote_run import listening

    with Graph.somatize(Body().at("gpu") >> Head()) as g:
        g.forward(x())
        for pid in (os.getpid(), runtime_for(g).peers["gpu"].pid):
            print("LISTENS", pid, *listening(pid))
        # TensorPipe binds the hostname's interface unless told: here the hostname may
        # resolve to loopback anyway, so what each side told it is checked as well
        print("IFNAME", os.environ.get("TP_SOCKET_IFNAME"),
              runtime_for(g).call("gpu", lambda live: os.environ.get("TP_SOCKET_IFNAME")))


class Echo(Node):
    """Answers a copy of the dict of tensors it is given."""

    def forward(self, x, ctx):
        return Done(Opaque({k: v.clone() for k, v in x.items()}))


def every_dtype() -> None:
    """Tensors cross as tensors, every dtype and bit kept."""
    x()
    sent = {"big": torch.tensor([2**60 + 1, -3]), "half": torch.randn(5).half(),
            "bf": torch.randn(5).bfloat16(), "bool": torch.tensor([True, False]),
            "view": torch.randn(4, 6)[:, ::2], "empty": torch.empty(0, 3)}
    with Graph.somatize(Echo().at("gpu")) as g:
        back = g.forward(sent)
    for k, v in sent.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def big_matrix_product() -> None:
    """A big matrix product over there equals here, with the worker's default threads."""
    from somatize.torch import node

    x()
    torch.set_num_threads(2)
    mlp = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 1024))
    big, odd = torch.randn(256, 784), torch.randn(7, 784)
    here = Graph.somatize(node(mlp)).forward(big)
    here_odd = Graph.somatize(node(mlp)).forward(odd)
    with Graph.somatize(node(mlp).at("gpu")) as g:
        assert torch.equal(g.forward(big), here)
        # a batch of 7 comes out differently with 1 and 2 threads on this CPU: the
        # worker's default (as many threads as here) keeps the equality
        assert torch.equal(g.forward(odd), here_odd)
        assert runtime_for(g).call("gpu", lambda live: torch.get_num_threads()) == 2
        # and its math threads sleep once a node is done, not spin on our cores
        assert runtime_for(g).call("gpu", lambda live: os.environ["OMP_WAIT_POLICY"]) == \
            "PASSIVE"


class Twice(Node):
    """Twice its input, and the pid of the process it ran in."""

    def forward(self, x, ctx):
        return Done(Opaque((x * 2, os.getpid())))


class Take(Node):
    """Answers what it is given."""

    def forward(self, x, ctx):
        return Done(x)


def by_value() -> None:
    """Classes defined in this script (``__main__``) travel by value and run over there."""
    xs = x()
    assert Twice.__module__ == "__main__", Twice.__module__
    with Graph.somatize(Twice().at("gpu") >> Take()) as g:
        y, pid = g.forward(xs)
    assert torch.equal(y, xs * 2) and pid != os.getpid()


def opaque_over_there() -> None:
    """An opaque value read only over there does not stop the stretch; read here, Lost."""
    xs = x()
    with Graph.somatize(Locked().at("gpu") >> Unlock().at("gpu")) as g:
        assert torch.equal(g.forward(xs), xs + 1)
    with Graph.somatize(Locked().at("gpu") >> Unlock()) as g:
        try:
            g.forward(xs)
            raise SystemExit("no Lost")
        except Lost as e:
            msg = str(e)
    assert "'unlock'" in msg and "'locked'" in msg, msg
    assert "the coordinator (here)" in msg and "worker 'gpu'" in msg, msg


def left_behind() -> None:
    """An outcome leaves behind what cannot travel and keeps what it answers with."""
    from somatize._engine import walk
    from somatize._values import Left

    xs = x()
    g = Graph.somatize(Locked().at("gpu") | Scale().at("gpu"))
    with g:
        out = walk(g, g.plan.order, inputs={"locked": xs, "scale": xs},
                   remote=runtime_for(g), wanted=g.sinks)
    assert isinstance(out.values["locked"], Left), out.values
    assert out.values["locked"].node == "locked" and out.values["locked"].host == "gpu"
    assert "lock" in out.values["locked"].why, out.values["locked"]
    assert torch.equal(out.values["scale"].value, xs * 2)
    assert sorted(out.ran) == ["locked", "scale"]


def worker_to_worker() -> None:
    """A value from one worker to another travels as an RRef, never coming here."""
    from torch._C._distributed_rpc import PyRRef

    from somatize._engine import walk

    xs = x()
    here = Graph.somatize(Body() >> Scale() >> Head()).forward(xs)
    g = Graph.somatize(Body().at("a") >> Scale().at("b") >> Head())
    with g:
        assert torch.equal(g.forward(xs), here)
        out = walk(g, g.plan.order, inputs={"body": xs}, remote=runtime_for(g),
                   wanted=g.sinks)
        assert isinstance(out.values["body"], PyRRef), out.values  # never came here
        assert torch.equal(out.values["head"].value, here)


class Meet(Node):
    """Touches its own file, then waits (20 s at most) for the other's."""

    def __init__(self, me, other):
        self.me, self.other = me, other

    def forward(self, x, ctx):
        pathlib.Path(self.me).touch()
        t = time.monotonic()
        while not pathlib.Path(self.other).exists():
            if time.monotonic() - t > 20:
                raise TimeoutError("the other stretch never started")
            time.sleep(0.01)
        return Done(Opaque(x))


def one_wave() -> None:
    """Two remote stretches of one wave, each waiting for the other: in flight together."""
    xs = x()
    a, b = "a.flag", "b.flag"
    g = Graph.somatize(Meet(a, b).named("ma").at("a") | Meet(b, a).named("mb").at("b"))
    with g:
        out = g.forward(xs)
    assert torch.equal(out["ma"], xs) and torch.equal(out["mb"], xs)


def _scale_runs(live):
    return type(live["scale"]).runs


def kept_over_there(store: str) -> None:
    """A worker that keeps (in ``store``) does not run again what it kept; one that does
    not runs it again. No store here: the names of what ran over there come back."""
    from somatize._engine import walk
    from somatize.torch import freeze

    xs = x()
    for keeps in (True, False):
        g = Graph.somatize(Scale().at("gpu").frozen().cached() >> Head(n_in=8))
        freeze(g)
        w = {"gpu": Worker.embedded(store=store if keeps else None)}
        with g:
            rt = runtime_for(g, w)
            assert rt.keeps() is keeps
            first = walk(g, g.plan.order, inputs={"scale": xs}, remote=rt,
                         naming=rt.keeps(), wanted=g.sinks)
            second = walk(g, g.plan.order, inputs={"scale": xs}, remote=rt,
                          naming=rt.keeps(), wanted=g.sinks)
            assert torch.equal(first.values["head"].value, second.values["head"].value)
            if keeps:
                assert first.ran == ["scale", "head"] and second.hits == ["scale"]
                assert second.ran == ["head"]
                assert rt.call("gpu", _scale_runs) == 1
                assert first.keys["scale"] and first.keys["scale"] == second.keys["scale"]
                assert first.keys["head"]  # named here from the name that came back
                g.forward(xs, workers=w)  # Graph.forward names for it too
                assert rt.call("gpu", _scale_runs) == 1
            else:
                assert second.ran == ["scale", "head"] and not second.hits
                assert rt.call("gpu", _scale_runs) == 2


def names_of_one_process(there: str) -> None:
    """The key a worker is brought and the key it gives back are the ones one process
    computes, and the worker keeps under them (in ``there``)."""
    from somatize._engine import walk
    from somatize.store import Store
    from somatize.torch import freeze

    xs = x()

    def build(at):
        return freeze(Graph.somatize(Scale(3.0).frozen() >> Scale().at(at).frozen().cached()
                                     >> Head(n_in=8)))

    one = build(None)
    local = walk(one, one.plan.order, inputs={"scale": xs}, naming=True, wanted=one.sinks)
    g = build("gpu")
    with g:
        rt = runtime_for(g, {"gpu": Worker.embedded(store=there)})
        out = walk(g, g.plan.order, inputs={"scale": xs}, remote=rt, naming=True,
                   wanted=g.sinks)
    assert out.keys == local.keys and all(local.keys.values()), (out.keys, local.keys)
    assert list(Store(there).names()) == ["value/" + local.keys["scale_2"]]


def another_catalog() -> None:
    """Provisioning refuses a different catalog on an open session."""
    g = Graph.somatize(Body().at("gpu") >> Head())
    g.provision()  # before any forward: not skipped
    w = runtime_for(g).call("gpu", lambda live: live["body"].lin.weight.clone())
    assert torch.equal(w, g["body"].lin.weight)
    other = Graph.somatize(Scale().at("gpu") >> Head(n_in=8))
    try:
        runtime_for(g).provision(other)
        raise SystemExit("not refused")
    except Refused as e:
        msg = str(e)
    assert "'body'" in msg and "'scale'" in msg and "gpu" in msg, msg
    g.close()


def two_graphs() -> None:
    """Two graphs in one process share a worker, each with its own catalog; prints the
    worker's pid."""
    xs = x()
    g1 = Graph.somatize(Body().at("gpu") >> Head())
    g2 = Graph.somatize(Scale().at("gpu") >> Head(n_in=8))
    y1, y2 = g1.forward(xs), g2.forward(xs)
    pid = runtime_for(g1).peers["gpu"].pid
    assert runtime_for(g2).peers["gpu"].pid == pid  # one process, two sessions
    g1.close()
    assert torch.equal(g2.forward(xs), y2)  # the other session lives on
    assert torch.equal(y1, Graph.somatize(Body() >> Head()).forward(xs))
    g2.close()  # the last one stops it
    print("PID", pid)


def quiet_close() -> None:
    """Trained and closed; two workers passing an RRef, closed together; a group started
    again after the last worker left; one left open until exit. Prints "done". (somatize's
    own INFO lines are turned off: what is watched for is anything else on stderr.)"""
    import logging

    logging.getLogger("somatize").setLevel(logging.WARNING)
    xs = x()
    g = Graph.somatize(Body().at("gpu") >> Head())
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    data = [(xs, torch.tensor([0, 1, 2, 0, 1]))] * 3
    with Trainer(g, cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                 trains=trains) as t:
        t.fit(data, epochs=2, progress=False)
    with Graph.somatize(Body().at("a") >> Scale().at("b") >> Head()) as g2:
        g2.forward(xs)
    Graph.somatize(Body().at("gpu") >> Head()).forward(xs)
    print("done")


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
