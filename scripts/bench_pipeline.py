"""Two one-core "hosts": the same MLP trained in one piece on one core, and split across
a worker on a second core, whole batches (k=1) and in micro-batches (k=4, 1F1B), side
by side in one run.

    python scripts/bench_pipeline.py                    # cores 0 and 1, 3 x 8 steps, batch 1024
    python scripts/bench_pipeline.py --cores 2,3 --steps 12 --repeats 5 --wire
    python scripts/bench_pipeline.py --wait 0.05        # halves that sleep instead of multiplying

Each process is pinned to its own core (every thread of it, ``os.sched_setaffinity``)
with one math thread (``torch.set_num_threads(1)``, ``Worker.embedded(threads=1)``); the
worker is pinned by its pid once it has started (nothing in somatize pins it). The body
(1024->1024->1024, ReLU) and the head (1024->1024->1024->10) cost about the same, so two
cores can at best halve a step. Prints milliseconds per step and the ratio to one piece,
then where the time of a split step goes: the body and the head alone on one core, the
best a k-piece pipeline can do with them, a bare round trip, and whether the two cores
compute at once at all (two vCPUs of a VM may share one physical core: then no split
beats one piece, and ``--wait`` shows the schedule on halves that share nothing).

Over a bandwidth-limited link (``tc ... tbf`` between network namespaces,
``scripts/hosts.sh up --rate 1gbit``) is not here yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle math threads sleep, as a worker's

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from somatize import Done, Graph, Node, Opaque, Worker  # noqa: E402
from somatize.torch import Split, Trainer, parameters  # noqa: E402

LR, WIDTH = 0.01, 1024


class Wait(torch.autograd.Function):
    """Stands for compute on a core of its own (another machine, an accelerator): sleeps
    ``ms`` per row forward and twice that backward, using no CPU."""

    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        time.sleep(ms * x.shape[0] / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.ms * grad.shape[0] / 1e3)
        return grad.clone(), None


class Body(Node):
    """Two 1024-wide layers: the half that runs on the worker (``wait``: a scale and a
    sleep of ``wait`` ms per row instead)."""

    def __init__(self, wait: float = 0.0):
        self.wait = wait
        self.net = (nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                                  nn.Linear(WIDTH, WIDTH), nn.ReLU()) if not wait
                    else nn.Linear(WIDTH, WIDTH, bias=False).requires_grad_(False))
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x, ctx):
        if self.wait:
            return Done(Opaque(Wait.apply(x * self.scale, self.wait)))
        return Done(Opaque(self.net(x) * self.scale))

    def parameters(self):
        return [*(p for p in self.net.parameters() if p.requires_grad), self.scale]


class Head(Node):
    """Two 1024-wide layers and the classifier: the half that runs here (``wait``: the
    classifier and a sleep of ``wait`` ms per row instead)."""

    def __init__(self, wait: float = 0.0):
        self.wait = wait
        self.net = (nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                                  nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
                    if not wait else nn.Linear(WIDTH, 10))

    def forward(self, x, ctx):
        return Done(Opaque(self.net(Wait.apply(x, self.wait) if self.wait else x)))

    def parameters(self):
        return list(self.net.parameters())


def graph(at: str | None, wait: float = 0.0) -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(Body(wait).at(at) >> Head(wait))


def pin(pid: int | str, core: int) -> None:
    """Every thread of process ``pid`` onto ``core`` (affinity is per thread on Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def trainer(k: int | None, wire: torch.dtype | None = None, wait: float = 0.0) -> Trainer:
    """One piece here (``k=None``), or the body on the worker, in ``k`` micro-batches."""
    g = graph(None if k is None else "gpu", wait)
    if k is None:
        return Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g), lr=LR))
    trains = {"body": Split(torch.optim.SGD, lr=LR, wire=wire)}
    return Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=LR),
                   trains=trains, workers={"gpu": Worker.embedded(threads=1)}, micro_batches=k)


def timed(t: Trainer, batch) -> float:
    """Milliseconds of one step (what it left in flight over there waited for)."""
    t0 = time.perf_counter()
    t.step(batch)
    t.flush()
    return (time.perf_counter() - t0) * 1e3


class Alone:
    """The body's and the head's forward + backward on one batch, here, timed apart."""

    def __init__(self, wait: float = 0.0):
        torch.manual_seed(0)
        self.body, self.head = Body(wait), Head(wait)

    def __call__(self, batch) -> dict[str, float]:
        x, y = batch
        t0 = time.perf_counter()
        a = self.body.forward(x, None).value.value
        a.backward(torch.ones_like(a))
        t1 = time.perf_counter()
        out = self.head.forward(a.detach().requires_grad_(), None).value.value
        F.cross_entropy(out, y).backward()
        t2 = time.perf_counter()
        return {"body alone": (t1 - t0) * 1e3, "head alone": (t2 - t1) * 1e3}


def round_trip(t: Trainer) -> float:
    """Milliseconds of a bare call to the worker and back."""
    rt = t._step.runtime
    ms = []
    for _ in range(20):
        t0 = time.perf_counter()
        rt.call("gpu", _nothing)
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def _nothing(live) -> None:
    return None


def gflops(seconds: float) -> float:
    """This thread's single-threaded 1024x1024 matrix products, in GFLOP/s."""
    a, b = torch.randn(WIDTH, WIDTH), torch.randn(WIDTH, WIDTH)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * WIDTH**3 * n / (time.perf_counter() - t0) / 1e9


def side_by_side(there: int) -> tuple[float, float]:
    """GFLOP/s here alone, then while a process on core ``there`` multiplies too: whether
    the two cores compute at once (on a VM two vCPUs may share one physical core)."""
    import subprocess

    alone = gflops(1.0)
    busy = subprocess.Popen([sys.executable, __file__, "--multiply-on", str(there)])
    time.sleep(0.5)
    both = gflops(1.0)
    busy.wait()
    return alone, both


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="0,1", help="the coordinator's core, the worker's core")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1024,
                    help="rows per batch (a piece of fewer than ~256 multiplies less efficiently)")
    ap.add_argument("--wire", action="store_true", help="also k=4 over a bfloat16 wire")
    ap.add_argument("--wait", type=float, default=0.0, metavar="MS",
                    help="each half sleeps MS per row forward (twice that backward) instead "
                         "of multiplying: halves on cores that do not share anything")
    ap.add_argument("--multiply-on", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.multiply_on is not None:  # side_by_side's other process
        pin(os.getpid(), args.multiply_on)
        gflops(2.0)
        return 0
    here, there = (int(c) for c in args.cores.split(","))
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, WIDTH, generator=gen),
             torch.randint(0, 10, (args.batch,), generator=gen)) for _ in range(args.steps)]

    w = args.wait
    runs = {"one piece, one core": trainer(None, wait=w), "split, k=1": trainer(1, wait=w),
            "split, k=4": trainer(4, wait=w)}
    if args.wire:
        runs["split, k=4, bf16 wire"] = trainer(4, torch.bfloat16, wait=w)
    for t in runs.values():
        for b in data[:2]:
            timed(t, b)  # warm: the worker is up, its threads made
    worker = next(iter(runs["split, k=1"].where()["body"]))
    pin(worker, there)
    pin(os.getpid(), here)
    alone = Alone(w)
    ms: dict[str, list[float]] = {name: [] for name in [*runs, "body alone", "head alone"]}
    for _ in range(args.repeats):
        for b in data:  # step by step in turn, so a slow moment of the machine is shared
            for name, t in runs.items():
                ms[name].append(timed(t, b))
            for name, v in alone(b).items():
                ms[name].append(v)
    med = {name: statistics.median(v) for name, v in ms.items()}
    one = med["one piece, one core"]
    model = (f"MLP {WIDTH}x2 body" if not w else f"body sleeping {w:g} ms/row")
    print(f"{model} on core {there} (worker pid {worker}), head on "
          f"core {here}, batch {args.batch}, SGD, one math thread each; medians of "
          f"{args.repeats} x {args.steps} steps, taken in turn")
    print(f"{'run':<24}{'ms/step':>10}{'x one piece':>14}")
    for name in runs:
        print(f"{name:<24}{med[name]:>10.1f}{med[name] / one:>14.2f}")
    b, h = med["body alone"], med["head alone"]
    rtt = round_trip(runs["split, k=1"])
    print(f"\nbody fwd+bwd alone {b:.1f} ms, head fwd+bwd alone {h:.1f} ms (one core each), "
          f"a bare round trip {rtt:.2f} ms")
    for k in (1, 4):
        best = max(b, h) + min(b, h) / k  # one side busy throughout, the other waits 1/k
        print(f"k={k}: the best two cores do with these halves, nothing moved: {best:.1f} ms "
              f"({best / one:.2f}x one piece)")
    alone_gf, both_gf = side_by_side(there)
    print(f"core {here} multiplies at {alone_gf:.0f} GFLOP/s alone, {both_gf:.0f} while core "
          f"{there} multiplies too ({both_gf / alone_gf:.2f}): the two cores together do "
          f"{2 * both_gf / alone_gf:.2f}x one")
    for t in runs.values():
        t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
