"""Training the half that is not here, in a worker process: the same numbers as the
whole net in one process, bit for bit. Each test runs its coordinator in a subprocess
(torch.distributed.rpc is initialised once per process) with an embedded worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRELUDE = """\
import functools, os
import torch, torch.nn.functional as F
from models import Body, Head, Pre, batches, same, twins, weights
from somatize import Graph
from somatize.torch import Split, Trainer, parameters
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
def split():
    return Split(torch.optim.SGD, lr=0.1, momentum=0.9)
def placed(g, hosts):
    for n, h in hosts.items():
        g[n].at(h)
    return Graph.somatize(g[g.roots[0]] if len(g.ids) == 1 else _chain(g))
def _chain(g):
    expr = g[g.plan.order[0]]
    for n in g.plan.order[1:]:
        expr = expr >> g[n]
    return expr
"""


def coordinate(code: str, tmp_path: Path, timeout: float = 120) -> str:
    script = tmp_path / "coordinator.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=tmp_path)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout


def test_a_graph_trained_across_a_worker_gives_the_same_numbers_as_the_whole_one(tmp_path):
    out = coordinate("""
        data = batches(10)
        for build in (lambda: Pre() >> Body(seed=None) >> Head(seed=None),
                      lambda: Body(seed=None) >> Head(seed=None)):
            whole, far = twins(build)
            far = placed(far, {"body": "gpu"})
            mine = weights(far)["body"]
            a = Trainer(whole, F.cross_entropy, SGD(parameters(whole)))
            trains = {"body": split()}
            with Trainer(far, F.cross_entropy, SGD(parameters(far, without=trains)),
                         trains=trains) as b:
                assert [a.step(d) for d in data] == [b.step(d) for d in data]
                sa, sb = a.state_dict(), b.state_dict()
                assert same(sa["nodes"], sb["nodes"])   # read over there
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
    """, tmp_path)
    assert out.split() == ["ok", "3", "ok", "2"]


def test_the_hand_written_loop_and_trainer_step_over_a_worker_give_the_same_losses(tmp_path):
    coordinate("""
        mine, theirs = twins(lambda: Body(seed=None) >> Head(seed=None))
        body, head = mine["body"].lin, mine["head"].lin
        opt = SGD([*body.parameters(), *head.parameters()])
        by_hand = []
        for x, y in batches(10):
            loss = F.cross_entropy(head(body(x).relu()), y)
            loss.backward(); opt.step(); opt.zero_grad()
            by_hand.append(loss.item())
        theirs = placed(theirs, {"body": "gpu"})
        trains = {"body": split()}
        with Trainer(theirs, F.cross_entropy, SGD(parameters(theirs, without=trains)),
                     trains=trains) as t:
            assert [t.step(b) for b in batches(10)] == by_hand
    """, tmp_path)


def test_stop_and_resume_over_a_worker_and_nothing_trained_here(tmp_path):
    coordinate("""
        data = batches(8)
        build = lambda: Pre() >> Body(seed=None) >> Head(seed=None)
        whole, far = twins(build)
        _, again = twins(build)
        a = Trainer(whole, F.cross_entropy, SGD(parameters(whole)))
        expected = [a.step(d) for d in data]
        def trainer(g):   # everything trained on the worker: no optimizer here
            g = placed(g, {"pre": "gpu", "body": "gpu", "head": "gpu"})
            return Trainer(g, F.cross_entropy, trains={n: split() for n in g.ids})
        with trainer(far) as first:
            got = [first.step(d) for d in data[:3]]
            saved = first.state_dict()
        with trainer(again) as resumed:   # a fresh worker session: all from `saved`
            resumed.load_state_dict(saved)
            got += [resumed.step(d) for d in data[3:]]
            assert got == expected
            assert same(resumed.state_dict()["nodes"], a.state_dict()["nodes"])
    """, tmp_path)


def test_a_far_half_nobody_trains_is_a_plain_step_and_gives_the_same_numbers(tmp_path):
    # CU14 decision 4: a slice on another host with nobody training it needs no stages
    coordinate("""
        from somatize.torch import freeze
        data = batches(6)
        whole, far = twins(lambda: Body(seed=None).frozen() >> Head(seed=None))
        far = placed(far, {"body": "gpu"})
        freeze(whole), freeze(far)
        start = weights(far)["head"]
        a = Trainer(whole, F.cross_entropy, SGD(parameters(whole)))
        with Trainer(far, F.cross_entropy, SGD(parameters(far))) as b:
            assert [a.step(d) for d in data] == [b.step(d) for d in data]
            assert os.getpid() not in b.where()["body"]  # it ran over there
        assert same(weights(whole), weights(far))
        assert not same(weights(far)["head"], start)  # the head trained, here
    """, tmp_path)



def test_where_the_far_sides_step_waits_for_the_next_input_the_weights_here_do_not(tmp_path):
    out = coordinate("""
        data = batches(4)
        whole, far = twins(lambda: Body(seed=None) >> Head(seed=None))
        far = placed(far, {"body": "gpu"})
        a = Trainer(whole, F.cross_entropy, SGD(parameters(whole)))
        trains = {"body": split()}
        with Trainer(far, F.cross_entropy, SGD(parameters(far, without=trains)),
                     trains=trains) as b:
            for d in data:  # step() on its own: the head here is up to date when it returns
                assert b.step(d) == a.step(d)
                assert same(weights(far)["head"], weights(whole)["head"])
            # inside fit the head's step is taken while the next stretch computes over there
            assert b.fit(data, progress=False) == [a.step(d) for d in data]
            assert same(weights(far)["head"], weights(whole)["head"])
            assert same(b.state_dict()["nodes"], a.state_dict()["nodes"])
        print("WAITED")
    """, tmp_path)
    assert "WAITED" in out
