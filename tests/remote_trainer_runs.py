"""Coordinators for tests/test_trainer_remote.py: the half that is not here, trained in a
worker, one function each. Each runs in a process of its own (RPC starts once per
process), as this script's ``__main__``, so a class defined here travels by value, as a
user's script's would, and those of ``models`` by reference. Each asserts what it can see
itself and prints the rest for the test to read.

    python tests/remote_trainer_runs.py trained_across
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from models import Body, Head, Pre, batches, twins
from oracle import same, weights
from torch.nn.functional import cross_entropy

from somatize import Done, Graph, Opaque, Refused
from somatize.torch import Split, Trainer, parameters


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
            # counted as the user counts calls: once a step, the Split's body as well
            assert list(ran["body"].values()) == [len(data)], ran
            assert ran["head"] == {os.getpid(): len(data)}, ran
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


def mirrored_body() -> None:
    """Pre >> Body >> Head, the body on a worker with nothing in trains= and its weights
    in the optimizer here (SGD with momentum, AdamW): trained over there by a mirror of
    that optimizer to the numbers of the whole graph here (losses, weights, every entry
    of the optimizer's state); stopped and resumed in a fresh session, the same again.
    Prints "ok mirrored <optimizer>" for each."""
    data = batches(8)
    for make in (_sgd, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05)):
        def build():
            return Pre() >> Body(seed=None) >> Head(seed=None)

        whole, far = twins(build)
        _, again = twins(build)
        far, again = _placed(far, {"body": "gpu"}), _placed(again, {"body": "gpu"})
        a = Trainer(whole, cross_entropy, make(parameters(whole)))
        expected = [a.step(d) for d in data]
        with Trainer(far, cross_entropy, make(parameters(far))) as b:
            got = [b.step(d) for d in data[:3]]
            saved = b.state_dict()
            assert os.getpid() not in b.where()["body"]  # it ran (and trained) over there
        with Trainer(again, cross_entropy, make(parameters(again))) as c:
            c.load_state_dict(saved)  # a fresh worker session: the body from `saved`
            got += [c.step(d) for d in data[3:]]
            assert got == expected, (got, expected)
            sa, sc = a.state_dict(), c.state_dict()
            assert same(sc["nodes"], sa["nodes"])
            assert sorted(sc["optimizer"]["state"]) == list(range(6))  # the body's too
            assert same(sc["optimizer"], sa["optimizer"])
        print("ok mirrored", type(make([torch.nn.Parameter(torch.ones(1))])).__name__)


class Picky(Body):
    """The body, refusing an input with a NaN in it (raised where it runs)."""

    def forward(self, x, ctx):
        if x.isnan().any():
            raise ValueError("a NaN in the input")
        return super().forward(x, ctx)


class Dicey(Body):
    """The body, with a layerdrop drawn from Python's global generator (where it runs)."""

    def forward(self, x, ctx):
        import random

        return super().forward(x * 0.5 if random.random() < 0.5 else x, ctx)


class Strange(Exception):
    """An exception of the script's own (it travels by value)."""


class Balks(Split):
    """A trainer whose learn raises, where it stands."""

    def learn(self, signal, ctx):
        raise Strange(f"{ctx.node} will not learn")


def _one_way(e: BaseException, node: str, cls: type, says: str) -> dict:
    """What a caught exception shows: its own type, the node and worker named, and the
    worker's traceback (with the line that raised) as its cause."""
    assert type(e) is cls, (type(e), e)
    assert f"node {node!r}" in str(e) and "worker 'gpu'" in str(e), str(e)
    cause = str(e.__cause__)
    assert type(e.__cause__).__name__ == "WorkerTraceback" and says in cause, cause
    return {"type": type(e).__name__, "message": str(e), "cause": cause}


def raised_there() -> None:
    """A node's ValueError raised on the worker is a ValueError here, with the worker's
    traceback as its cause and the node and worker named: in g.forward, in Trainer.step
    (and the run goes on), and a trainer's own exception in its learn. Prints one JSON
    line of what each showed."""
    import json

    x, y = batches(1)[0]
    nan = torch.full_like(x, float("nan"))
    got = {}
    with Graph.somatize(Picky(seed=None).at("gpu") >> Head(seed=None)) as g:
        try:
            g.forward(nan)
        except ValueError as e:
            got["forward"] = _one_way(e, "picky", ValueError, 'raise ValueError("a NaN')
    with Graph.somatize(Dicey(seed=None).at("gpu") >> Head(seed=None)) as g:
        try:
            g.forward(x)
        except Refused as e:
            got["drawn"] = {"type": type(e).__name__, "message": str(e), "cause": ""}
    g = Graph.somatize(Picky(seed=None).at("gpu") >> Head(seed=None))
    with Trainer(g, cross_entropy, _sgd(parameters(g))) as t:  # picky mirrored
        t.step((x, y))
        try:
            t.step((nan, y))
        except ValueError as e:
            got["step"] = _one_way(e, "picky", ValueError, 'raise ValueError("a NaN')
        got["then"] = t.step((x, y))  # the next batch trains as ever
    # (not the graph's root: its learn is a call, not an envelope riding the next input)
    g = Graph.somatize(Pre() >> Picky(seed=None).at("gpu") >> Head(seed=None))
    trains = {"picky": Balks(torch.optim.SGD, lr=0.1)}
    with Trainer(g, cross_entropy, _sgd(parameters(g, without=trains)), trains=trains) as t:
        try:
            t.step((x, y))
        except Strange as e:
            got["learn"] = _one_way(e, "picky", Strange, "will not learn")
    print(json.dumps(got))


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


GAIN = 1.0
CFG = {"gain": 1.0}


@dataclasses.dataclass
class Knobs:
    scale: float = 1.0


KNOBS = Knobs()


class Gained(Body):
    """The body, scaled by a module-level float and a config dict's entry (read where it
    runs: the worker's copy of this script's globals)."""

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x).relu() * GAIN * CFG["gain"] * KNOBS.scale))


def globals_follow() -> None:
    """A placed node's globals changed here mid-run (one rebound, a dict changed in place,
    a dataclass's field set) are what its code reads over there: trained there by a Split,
    by a mirror of the optimizer here, or frozen; the numbers of one piece, bit for bit.
    One rebound to a function is refused, naming the node and the name. Prints "ok <how>"
    for each."""
    global GAIN
    data = batches(6)
    for how in ("split", "mirrored", "frozen"):
        GAIN, CFG["gain"], KNOBS.scale = 1.0, 1.0, 1.0
        whole, far = twins(lambda how=how: (Gained(seed=None).frozen() if how == "frozen"
                                            else Gained(seed=None)) >> Head(seed=None))
        far = _placed(far, {"gained": "gpu"})
        trains = {"gained": _split()} if how == "split" else {}
        a = Trainer(whole, cross_entropy, _sgd(parameters(whole)))
        with Trainer(far, cross_entropy, _sgd(parameters(far, without=trains)),
                     trains=trains) as b:
            for i, d in enumerate(data):
                if i == 2:
                    GAIN = 3.0  # rebound here, by a callback say
                if i == 3:
                    KNOBS.scale = 2.0  # a config object's field
                if i == 4:
                    CFG["gain"] = 0.5  # changed in place
                assert a.step(d) == b.step(d), (how, i)
            assert os.getpid() not in b.where()["gained"]  # it ran over there
            if how == "split":
                GAIN = abs  # what cannot travel as data
                try:
                    b.step(data[0])
                except Refused as e:
                    assert str(e).startswith(
                        "Gained.forward reads the global 'GAIN', which was set here to a "
                        "builtin_function_or_method after 'gained' was placed on worker "
                        "'gpu'"), str(e)
                else:
                    raise AssertionError("a global rebound to a function was not refused")
        print("ok", how)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
