"""Coordinators for the remote tests, one function each. Each runs in a process of its
own (RPC starts once per process), as this script's ``__main__``, so a class defined here
travels by value, as a user's script's would, and those of ``models`` by reference. Each
asserts what it can see itself and says the rest on stdout for the test to read: the
reliability ones one JSON object a line.

    python tests/remote_scripts.py lost_worker
    python tests/remote_scripts.py interrupted forward /tmp/pid.txt
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading
import time

import torch
from models import (
    Body,
    Boom,
    Head,
    Holding,
    Locked,
    Nap,
    Pre,
    Scale,
    Sleepy,
    Unlock,
    batches,
    same,
    twins,
    weights,
)
from torch.nn.functional import cross_entropy

from somatize import Done, Graph, Lost, Node, Opaque, Refused, SomatizeError, WorkerError
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


# -- tests/test_remote.py, test_remote_failure.py, test_remote_standing.py ----------------

def worker_error(g, xs, **kw) -> tuple[str, float]:
    """``g.forward`` must raise WorkerError: its message, and the seconds it took."""
    t = time.monotonic()
    try:
        g.forward(xs, **kw)
    except WorkerError as e:
        return str(e), time.monotonic() - t
    raise SystemExit("no error")


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


def boom_over_there() -> None:
    """An exception in a node over there names the worker and the node."""
    xs = x()
    with Graph.somatize(Body().at("gpu") >> Boom().at("gpu") >> Head()) as g:
        msg, _ = worker_error(g, xs)
    assert "'boom'" in msg and "'gpu'" in msg and "ValueError" in msg, msg
    assert "boom inside the node" in msg and "Traceback" in msg, msg


def too_long() -> None:
    """A call that takes too long fails within the timeout (3 s), not the 30 s sleep."""
    xs = x()
    g = Graph.somatize(Sleepy("pid.txt", 30).at("gpu"))
    msg, took = worker_error(g, xs, workers={"gpu": Worker.embedded(timeout=3)})
    assert "'gpu'" in msg and "sleepy" in msg and "3 s" in msg, msg
    assert took < 25, took  # bounded by the timeout, not by the 30 s sleep
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
    again after the last worker left; one left open until exit. Prints "done"."""
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


# -- tests/test_trainer_remote.py: the half that is not here, trained in a worker ---------

def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _split() -> Split:
    return Split(torch.optim.SGD, lr=0.1, momentum=0.9)


def _placed(g: Graph, hosts: dict[str, str]) -> Graph:
    """``g``'s nodes, those named in ``hosts`` placed there, as a chain in plan order."""
    for n, h in hosts.items():
        g[n].at(h)
    if len(g.ids) == 1:
        return Graph.somatize(g[g.roots[0]])
    expr = g[g.plan.order[0]]
    for n in g.plan.order[1:]:
        expr = expr >> g[n]
    return Graph.somatize(expr)


def trained_across() -> None:
    """Pre >> Body >> Head and Body >> Head, the body trained on a worker: the numbers of
    the whole graph here, bit for bit; prints "ok <nodes>" for each."""
    data = batches(10)
    for build in (lambda: Pre() >> Body(seed=None) >> Head(seed=None),
                  lambda: Body(seed=None) >> Head(seed=None)):
        whole, far = twins(build)
        far = _placed(far, {"body": "gpu"})
        mine = weights(far)["body"]
        a = Trainer(whole, cross_entropy, _sgd(parameters(whole)))
        trains = {"body": _split()}
        with Trainer(far, cross_entropy, _sgd(parameters(far, without=trains)),
                     trains=trains) as b:
            assert [a.step(d) for d in data] == [b.step(d) for d in data]
            sa, sb = a.state_dict(), b.state_dict()
            assert same(sa["nodes"], sb["nodes"])  # read over there
            # the body ran in the worker's process, the rest here; the transpose reached
            # the trainer the worker has live: its optimizer over there holds momentum,
            # the copy here never stepped
            ran = b.where()
            assert set(ran["body"]) != {os.getpid()} and len(ran["body"]) == 1
            assert set(ran["head"]) == {os.getpid()}
            assert sb["trainers"]["body"]["optimizer"]["state"]
            assert not trains["body"].state_dict()["optimizer"]["state"]
            # nothing pulled the weights back behind the user's back
            assert same(weights(far)["body"], mine)
        print("ok", len(far.ids))


def _math_there(live) -> list:
    return [torch.get_num_threads(), torch.get_float32_matmul_precision(),
            torch.are_deterministic_algorithms_enabled()]


def math_follows() -> None:
    """The math settings here reach the worker before the step that runs under them
    (the graph route); prints what the worker had after each step."""
    g = _placed(Graph.somatize(Body(seed=None) >> Head(seed=None)), {"body": "gpu"})
    trains = {"body": _split()}
    with Trainer(g, cross_entropy, _sgd(parameters(g, without=trains)), trains=trains) as t:
        for (xs, y), (threads, precision, det) in zip(batches(3), [
                (1, "high", True), (2, "medium", False), (1, "highest", False)], strict=True):
            torch.set_num_threads(threads)
            torch.set_float32_matmul_precision(precision)
            torch.use_deterministic_algorithms(det)
            t.step((xs, y))
            print(*t.runtime.call("gpu", _math_there))


def by_hand_and_step() -> None:
    """A hand-written loop here and Trainer.step over a worker give the same losses."""
    mine, theirs = twins(lambda: Body(seed=None) >> Head(seed=None))
    body, head = mine["body"].lin, mine["head"].lin
    opt = _sgd([*body.parameters(), *head.parameters()])
    by_hand = []
    for xs, y in batches(10):
        loss = cross_entropy(head(body(xs).relu()), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        by_hand.append(loss.item())
    theirs = _placed(theirs, {"body": "gpu"})
    trains = {"body": _split()}
    with Trainer(theirs, cross_entropy, _sgd(parameters(theirs, without=trains)),
                 trains=trains) as t:
        assert [t.step(b) for b in batches(10)] == by_hand


def stop_and_resume() -> None:
    """Everything trained on the worker, stopped after 3 steps and resumed in a fresh
    session from the state saved: the numbers of one uninterrupted run here."""
    data = batches(8)

    def build():
        return Pre() >> Body(seed=None) >> Head(seed=None)

    whole, far = twins(build)
    _, again = twins(build)
    a = Trainer(whole, cross_entropy, _sgd(parameters(whole)))
    expected = [a.step(d) for d in data]

    def trainer(g):  # everything trained on the worker: no optimizer here
        g = _placed(g, {"pre": "gpu", "body": "gpu", "head": "gpu"})
        return Trainer(g, cross_entropy, trains={n: _split() for n in g.ids})

    with trainer(far) as first:
        got = [first.step(d) for d in data[:3]]
        saved = first.state_dict()
    with trainer(again) as resumed:  # a fresh worker session: all from `saved`
        resumed.load_state_dict(saved)
        got += [resumed.step(d) for d in data[3:]]
        assert got == expected
        assert same(resumed.state_dict()["nodes"], a.state_dict()["nodes"])


def nobody_trains_there() -> None:
    """A frozen body on a worker, the head trained here: a plain step, the same numbers."""
    from somatize.torch import freeze

    data = batches(6)
    whole, far = twins(lambda: Body(seed=None).frozen() >> Head(seed=None))
    far = _placed(far, {"body": "gpu"})
    freeze(whole), freeze(far)
    start = weights(far)["head"]
    a = Trainer(whole, cross_entropy, _sgd(parameters(whole)))
    with Trainer(far, cross_entropy, _sgd(parameters(far))) as b:
        assert [a.step(d) for d in data] == [b.step(d) for d in data]
        assert os.getpid() not in b.where()["body"]  # it ran over there
    assert same(weights(whole), weights(far))
    assert not same(weights(far)["head"], start)  # the head trained, here


def head_up_to_date() -> None:
    """step() leaves the head here up to date; fit() steps it while the next stretch
    computes over there, and ends with the same numbers. Prints WAITED."""
    data = batches(4)
    whole, far = twins(lambda: Body(seed=None) >> Head(seed=None))
    far = _placed(far, {"body": "gpu"})
    a = Trainer(whole, cross_entropy, _sgd(parameters(whole)))
    trains = {"body": _split()}
    with Trainer(far, cross_entropy, _sgd(parameters(far, without=trains)),
                 trains=trains) as b:
        for d in data:  # step() on its own: the head here is up to date when it returns
            assert b.step(d) == a.step(d)
            assert same(weights(far)["head"], weights(whole)["head"])
        # inside fit the head's step is taken while the next stretch computes over there
        assert b.fit(data, progress=False) == [a.step(d) for d in data]
        assert same(weights(far)["head"], weights(whole)["head"])
        assert same(b.state_dict()["nodes"], a.state_dict()["nodes"])
    print("WAITED")



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
