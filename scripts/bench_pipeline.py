"""Two one-core "hosts": the same MLP trained in one piece on one core, and split across
a worker on a second core, whole batches (k=1) and in micro-batches (k=4, 1F1B), side
by side in one run.

    python scripts/bench_pipeline.py                     # cores 0 and 1, medians of 3 x 8 steps
    python scripts/bench_pipeline.py --cores 2,3 --steps 12 --repeats 5 --wire

Each process is pinned to its own core (every thread of it, ``os.sched_setaffinity``)
with one math thread (``torch.set_num_threads(1)``, ``Worker.embedded(threads=1)``); the
worker is pinned by its pid once it has started (nothing in somatize pins it). The body
(1024->1024->1024, ReLU) and the head (1024->1024->1024->10) cost about the same, so two
cores can at best halve a step. Prints milliseconds per step and the ratio to one piece,
then where the time of a split step goes: the body and the head alone on one core, the
best a k-piece pipeline can do with them, and a bare round trip.

Over a bandwidth-limited link (``tc ... tbf`` between network namespaces) is not here:
it needs the hosts that tests/hosts.py builds.
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

LR, WIDTH, BATCH = 0.01, 1024, 256


class Body(Node):
    """Two 1024-wide layers: the half that runs on the worker."""

    def __init__(self):
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                                 nn.Linear(WIDTH, WIDTH), nn.ReLU())

    def forward(self, x, ctx):
        return Done(Opaque(self.net(x)))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    """Two 1024-wide layers and the classifier: the half that runs here."""

    def __init__(self):
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                                 nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))

    def forward(self, x, ctx):
        return Done(Opaque(self.net(x)))

    def parameters(self):
        return list(self.net.parameters())


def graph(at: str | None) -> Graph:
    torch.manual_seed(0)
    return Graph.somatize(Body().at(at) >> Head())


def pin(pid: int | str, core: int) -> None:
    """Every thread of process ``pid`` onto ``core`` (affinity is per thread on Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def trainer(k: int | None, wire: torch.dtype | None = None) -> Trainer:
    """One piece here (``k=None``), or the body on the worker, in ``k`` micro-batches."""
    g = graph(None if k is None else "gpu")
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

    def __init__(self):
        torch.manual_seed(0)
        self.body, self.head = Body().net, Head().net

    def __call__(self, batch) -> dict[str, float]:
        x, y = batch
        t0 = time.perf_counter()
        a = self.body(x)
        a.backward(torch.ones_like(a))
        t1 = time.perf_counter()
        F.cross_entropy(self.head(a.detach().requires_grad_()), y).backward()
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="0,1", help="the coordinator's core, the worker's core")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wire", action="store_true", help="also k=4 over a bfloat16 wire")
    args = ap.parse_args()
    here, there = (int(c) for c in args.cores.split(","))
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(BATCH, WIDTH, generator=gen),
             torch.randint(0, 10, (BATCH,), generator=gen)) for _ in range(args.steps)]

    runs = {"one piece, one core": trainer(None), "split, k=1": trainer(1),
            "split, k=4": trainer(4)}
    if args.wire:
        runs["split, k=4, bf16 wire"] = trainer(4, torch.bfloat16)
    for t in runs.values():
        for b in data[:2]:
            timed(t, b)  # warm: the worker is up, its threads made
    worker = next(iter(runs["split, k=1"].where()["body"]))
    pin(worker, there)
    pin(os.getpid(), here)
    alone = Alone()
    ms: dict[str, list[float]] = {name: [] for name in [*runs, "body alone", "head alone"]}
    for _ in range(args.repeats):
        for b in data:  # step by step in turn, so a slow moment of the machine is shared
            for name, t in runs.items():
                ms[name].append(timed(t, b))
            for name, v in alone(b).items():
                ms[name].append(v)
    med = {name: statistics.median(v) for name, v in ms.items()}
    one = med["one piece, one core"]
    print(f"MLP {WIDTH}x2 body on core {there} (worker pid {worker}), {WIDTH}x2+10 head on "
          f"core {here}, batch {BATCH}, SGD, one math thread each; medians of "
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
    for t in runs.values():
        t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
