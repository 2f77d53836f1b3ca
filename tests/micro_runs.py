"""Micro-batch runs: the one-piece oracle, and the runs over an embedded worker, each
coordinator in its own process (RPC starts once per process). tests/test_microbatches*.py
call them.

    python tests/micro_runs.py exact        # prints "ok <case>" per case
    python tests/micro_runs.py wire         # prints a JSON line: accuracies and bytes
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import sys

import torch
import torch.nn.functional as F
from models import Body, Drop, Head, Pre, batches, twins
from oracle import same, weights
from torch import nn

from somatize import Done, Graph, Node, Opaque

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def split():
    from somatize.torch import Split

    return Split(torch.optim.SGD, lr=0.1, momentum=0.9)


def one_piece(graph: Graph, data, k: int) -> list[float]:
    """Train ``graph`` in this process, no trainers: each batch cut with tensor_split(k)
    (each piece a tensor of its own), loss_i / k, backward per piece in order, one
    optimizer step per batch; the batch's loss is the sum of the pieces' in order."""
    from somatize.torch import parameters

    opt = SGD(parameters(graph))
    losses = []
    for x, t in data:
        total = None
        for xi, ti in zip(x.tensor_split(k), t.tensor_split(k), strict=True):
            loss = F.cross_entropy(graph.forward(xi.clone(), training=True), ti.clone()) / k
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return losses


def placed(g: Graph, hosts: dict[str, str]) -> Graph:
    """A chain graph again, with ``hosts`` placing its nodes."""
    for n, h in hosts.items():
        g[n].at(h)
    expr = g[g.plan.order[0]]
    for n in g.plan.order[1:]:
        expr = expr >> g[n]
    return Graph.somatize(expr)


# the cases: (name, build, placement, rows per batch, k); at most one side draws
EXACT = [
    ("k=1 head draws", lambda: Body(seed=None) >> Drop() >> Head(seed=None), {"body": "gpu"},
     16, 1),
    ("k=2 pre here", lambda: Pre() >> Body(seed=None) >> Head(seed=None), {"body": "gpu"}, 16, 2),
    ("k=4 head draws", lambda: Body(seed=None) >> Drop() >> Head(seed=None), {"body": "gpu"},
     16, 4),
    ("k=4 rows=10", lambda: Body(seed=None) >> Head(seed=None), {"body": "gpu"}, 10, 4),
    ("k=4 two workers", lambda: Pre() >> Body(seed=None) >> Head(seed=None),
     {"pre": "gpu", "body": "cpu"}, 10, 4),
    # nothing in trains=: the optimizer here holds every weight, mirrored over there
    ("k=4 two workers mirrored", lambda: Pre() >> Body(seed=None) >> Head(seed=None),
     {"pre": "gpu", "body": "cpu"}, 10, 4),
]


def exact() -> None:
    """Each case trained over workers equals one piece: losses ==, weights torch.equal."""
    import os

    from somatize.torch import Trainer, parameters

    # one worker process per host serves every case in turn (a session each)
    hold = Graph.somatize(Pre().at("gpu") >> Pre().at("cpu"))
    hold.forward(torch.zeros(1, 8))
    for name, build, hosts, rows, k in EXACT:
        whole, far = twins(build)
        far = placed(far, hosts)
        data = batches(5, size=rows)
        torch.manual_seed(1)  # the head's dropout draws the same masks in both runs
        want = one_piece(whole, data, k)
        trains = {} if name.endswith("mirrored") else {n: split() for n in hosts}
        with Trainer(far, F.cross_entropy, SGD(parameters(far, without=trains)),
                     trains=trains, micro_batches=k) as t:
            torch.manual_seed(1)
            got = [t.step(d) for d in data]
            state = t.state_dict()
            ran = t.where()
        assert got == want, (name, got, want)
        mine = weights(far)
        assert all(same(mine[n], weights(whole)[n]) for n in mine if n not in hosts), name
        for n in hosts:  # read over there
            assert same(list(state["nodes"][n].values()), weights(whole)[n]), (name, n)
            assert os.getpid() not in ran[n], (name, n)
        print("ok", name, flush=True)
    hold.close()


class Picky(Body):
    """The body, refusing a piece with a NaN in it (raised on the worker)."""

    def forward(self, x, ctx):
        if x.isnan().any():
            raise ValueError("a NaN in the input")  # its own type here too
        return super().forward(x, ctx)


def failed_batch() -> None:
    """A batch that fails midway, here (the objective, on its third piece) or on the
    worker (the body, on its third piece), leaves nothing behind on either side: the run
    goes on as if that batch had never been."""
    from somatize.torch import Trainer, parameters

    data = batches(5, size=16)
    x, y = data[3]
    poisoned = (torch.cat([x[:8], torch.full((8, 8), float("nan"))]), y)
    whole, far = twins(lambda: Picky(seed=None) >> Head(seed=None))
    far = placed(far, {"picky": "gpu"})
    want = one_piece(whole, [data[0], data[2], data[4]], 4)
    calls = []

    def fails_once(out, target):
        calls.append(1)
        if len(calls) == 7:  # the second batch's third piece
            raise RuntimeError("the objective failed")
        return F.cross_entropy(out, target)

    trains = {"picky": split()}
    with Trainer(far, fails_once, SGD(parameters(far, without=trains)), trains=trains,
                 micro_batches=4) as t:
        got = [t.step(data[0])]
        try:
            t.step(data[1])
        except RuntimeError as e:
            assert "the objective failed" in str(e)
        else:
            raise AssertionError("the objective did not fail")
        got.append(t.step(data[2]))
        try:
            t.step(poisoned)
        except ValueError as e:  # as raised over there, the worker's traceback its cause
            assert "raised in node 'picky' on worker 'gpu'" in str(e), e
            assert 'raise ValueError("a NaN in the input")' in str(e.__cause__), e.__cause__
        else:
            raise AssertionError("the body did not fail")
        got.append(t.step(data[4]))
        assert got == want, (got, want)
        assert same(list(t.state_dict()["nodes"]["picky"].values()), weights(whole)["picky"])
    print("ok failed batch")


def feeds_back() -> None:
    """Whether each trainer's copy on its worker computes dL/d(its input): only where
    something upstream learns (a trainer sent before it was told would answer it, an
    activation's worth of bytes each step for nobody)."""
    from somatize.torch import Trainer, parameters

    g = placed(Graph.somatize(Pre() >> Body() >> Head()), {"pre": "gpu", "body": "gpu"})
    trains = {"pre": split(), "body": split()}
    with Trainer(g, F.cross_entropy, SGD(parameters(g, without=trains)), trains=trains) as t:
        print(json.dumps(t.runtime.call("gpu", _feeds)))


def _feeds(live) -> dict[str, bool]:
    return {n: live.catalog[n].feeds_back for n in ("pre", "body")}


# -- the wire ------------------------------------------------------------------------

class DigitsBody(Node):
    """The seeds' body, sized for digits: 64 pixels to 32 features."""

    def __init__(self):
        self.lin = nn.Linear(64, 32)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x).relu()))

    def parameters(self):
        return list(self.lin.parameters())


class DigitsHead(Node):
    """The seeds' head, sized for digits: 32 features to ten digits' logits."""

    def __init__(self):
        self.lin = nn.Linear(32, 10)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


def digits(batch: int = 64, seed: int = 0):
    """scikit-learn's digits in [0, 1], split 80/20 with a fixed seed: (train batches,
    (held-out x, held-out y))."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, held = order[:cut], order[cut:]
    return ([(x[i], y[i]) for i in train.split(batch)]), (x[held], y[held])


class Crossing:
    """Counts the tensor bytes of activations and gradients the transport carries: what
    stretches answer, gradients riding with an input, and what trainers are sent and
    answer (``rpc_async`` wrapped while it lives; the batches sent are not counted)."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        import torch.distributed.rpc as rpc

        from somatize._learning import is_envelope
        from somatize.remote import _serve

        self._rpc, self._real = rpc, rpc.rpc_async

        def counted(to, fn, args=(), kwargs=None, timeout=-1.0):
            if fn is _serve.run:  # a gradient riding with the next input
                self.bytes += sum(tensor_bytes(v.signal) for v in args[1].inputs.values()
                                  if is_envelope(v))
            elif fn is _serve.call:  # a trainer's learn: dL/dy in, dL/dx out
                self.bytes += tensor_bytes(args[2:])
            fut = self._real(to, fn, args=args, kwargs=kwargs, timeout=timeout)
            if fn not in (_serve.run, _serve.call):
                return fut
            return fut.then(lambda f: self._answered(f.value()))

        rpc.rpc_async = counted
        return self

    def _answered(self, value):
        self.bytes += tensor_bytes(value)
        return value

    def __exit__(self, *exc):
        self._rpc.rpc_async = self._real


class _Tensors(pickle.Pickler):
    def __init__(self, f):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.bytes = 0

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self.bytes += obj.nelement() * obj.element_size()
            return id(obj)
        return None


def tensor_bytes(obj) -> int:
    """The bytes of the tensors inside ``obj``, as a pickler meets them."""
    p = _Tensors(io.BytesIO())
    p.dump(obj)
    return p.bytes


def wire(epochs: int = 10) -> None:
    """The digits trained with the body on a worker, with and without wire=bfloat16:
    prints held-out accuracies and the activation and gradient bytes that crossed."""
    from somatize.torch import Split, Trainer, parameters

    data, (hx, hy) = digits()
    out = {}
    for name, kw in (("plain", {}), ("bf16", {"wire": torch.bfloat16})):
        torch.manual_seed(0)
        g = Graph.somatize(DigitsBody().named("body").at("gpu") >> DigitsHead().named("head"))
        trains = {"body": Split(torch.optim.SGD, lr=0.1, momentum=0.9, **kw)}
        with Trainer(g, F.cross_entropy, SGD(parameters(g, without=trains)),
                     trains=trains) as t:
            with Crossing() as crossed:
                losses = t.fit(data, epochs=epochs, progress=False)
            state = t.state_dict()["nodes"]
        body, head = DigitsBody(), DigitsHead()
        with torch.no_grad():
            for node, n in ((body, "body"), (head, "head")):
                node.lin.weight.copy_(state[n]["lin.weight"])
                node.lin.bias.copy_(state[n]["lin.bias"])
            right = (head.lin(body.lin(hx).relu()).argmax(1) == hy).float().mean().item()
        out[name] = {"accuracy": right, "bytes": crossed.bytes, "loss": losses[-1]}
    print(json.dumps(out))


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
