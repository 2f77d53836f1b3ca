"""Coordinators for tests/test_remote_standing.py, tests/test_remote_torchrun.py and
tests/test_hosts.py: workers standing at an address, started by torchrun, or on other
test hosts, one function each. Each runs in a process of its own (RPC starts once per
process), as this script's ``__main__``, so a class defined here travels by value, as a
user's script's would, and those of ``models`` by reference. Each asserts what it can see
itself and prints the rest for the test to read.

    python tests/remote_standing_runs.py standing 127.0.0.1:7000
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from models import Body, Head, Sleepy
from remote_common import worker_error, x

from somatize import Done, Graph, Node, Opaque, WorkerError
from somatize.remote import Worker, runtime_for


def standing(address: str) -> None:
    """The seeds' graph on the standing worker at ``address`` equals one process; prints
    the pid of the process that served this run."""
    xs = x()
    here = Graph.somatize(Body() >> Head()).forward(xs)
    w = {"gpu": Worker.at(address, timeout=30)}
    with Graph.somatize(Body().at("gpu") >> Head()) as g:
        assert torch.equal(g.forward(xs, workers=w), here)
        assert torch.equal(g.forward(xs, workers=w), here)
        print("PID", runtime_for(g).peers["gpu"].pid)


def nobody_standing(address: str) -> None:
    """A standing worker nobody listens for at ``address``: prints the error."""
    g = Graph.somatize(Body().at("gpu") >> Head())
    try:
        g.forward(x(), workers={"gpu": Worker.at(address)})
    except WorkerError as e:
        print(e)


def torchrun() -> None:
    """Under torchrun: rank 1 serves the graph's "gpu", rank 0 runs the seeds' graph with
    its body there and prints EQUAL when it equals one process."""
    from somatize.remote import serve_if_worker

    assert serve_if_worker()  # rank 1 serves and never returns
    xs = x()
    here = Graph.somatize(Body() >> Head()).forward(xs)
    with Graph.somatize(Body().at("gpu") >> Head()) as g:
        y = g.forward(xs)
        assert runtime_for(g).peers["gpu"].kind == "torchrun"
        assert runtime_for(g).call("gpu", lambda live: int(os.environ["RANK"])) == 1
    assert torch.equal(y, here)
    print("EQUAL", flush=True)


# -- tests/test_hosts.py: the coordinator on test host a, listening on ``listen`` --------

def _listen_on(listen: str) -> None:
    import somatize.remote

    somatize.remote.configure(listen=listen)  # where the workers on other hosts reach it


def host_standing(listen: str, address: str) -> None:
    """The seeds' graph on the standing worker at ``address`` equals one process; prints
    the network namespace and pid of the process that served it, then EQUAL."""
    _listen_on(listen)
    xs = x()
    here = Graph.somatize(Body() >> Head()).forward(xs)
    with Graph.somatize(Body().at("gpu") >> Head()) as g:
        y = g.forward(xs, workers={"gpu": Worker.at(address, timeout=30)})
        net = runtime_for(g).call("gpu", lambda live: os.readlink("/proc/self/ns/net"))
        print("NET", net, "PID", runtime_for(g).peers["gpu"].pid)
    assert torch.equal(y, here)
    print("EQUAL")


def host_again(listen: str, address: str) -> None:
    """The seeds' graph on the standing worker at ``address`` equals one process: EQUAL."""
    _listen_on(listen)
    xs = x()
    here = Graph.somatize(Body() >> Head()).forward(xs)
    with Graph.somatize(Body().at("gpu") >> Head()) as g:
        y = g.forward(xs, workers={"gpu": Worker.at(address, timeout=30)})
    assert torch.equal(y, here)
    print("EQUAL")


class Big(Node):
    """16 MB made from the input."""

    def forward(self, x, ctx):
        return Done(Opaque(torch.arange(4 * 2**20, dtype=torch.float32) + x.sum()))


class Total(Node):
    """The sum of what it is given: one number."""

    def forward(self, x, ctx):
        return Done(Opaque(x.sum(dtype=torch.float64).reshape(1)))


def _two_chains(b1="b1", c1="c1", b2="b2", c2="c2") -> Graph:
    return Graph.somatize((Big().at(b1) >> Total().at(c1)) | (Big().at(b2) >> Total().at(c2)))


def four_workers(listen: str, ports: str) -> None:
    """Two chains Big >> Total over the four standing workers ``ports`` (JSON: name ->
    address) equal one process; prints their pids."""
    _listen_on(listen)
    xs = x()
    here = _two_chains(None, None, None, None).forward(xs)
    workers = {n: Worker.at(at, timeout=30) for n, at in json.loads(ports).items()}
    with _two_chains() as g:
        y = g.forward(xs, workers=workers)
        pids = {n: p.pid for n, p in runtime_for(g).peers.items()}
    assert y.keys() == here.keys() == {"total", "total_2"}
    assert all(torch.equal(y[k], here[k]) for k in y)
    print("PIDS", *pids.values())


def cut_off(listen: str, pid_file: str, address: str) -> None:
    """A node sleeping 1 s on the worker at ``address`` (call timeout 3 s), its host cut
    off meanwhile: prints when the WorkerError came, and its message."""
    _listen_on(listen)
    xs = x()
    g = Graph.somatize(Body().at("gpu") >> Sleepy(pid_file, 1).at("gpu") >> Head())
    msg, _ = worker_error(g, xs, workers={"gpu": Worker.at(address, timeout=3)})
    print("AT", time.time(), "MSG", msg, flush=True)
    g.close()


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
