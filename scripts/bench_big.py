"""A training step whose activation is large (1 GiB by default) crossing the cut, side by
side in one run: the same two modules trained in one piece here, and split (the body on
a local worker, its head here), with a bare ``rpc_sync`` of the same bytes (TensorPipe's
own floor for what the step moves) measured in the same run.

    python scripts/bench_big.py                # 1 GiB, 5 alternated rounds, ~2 minutes
    python scripts/bench_big.py --mib 256 --rounds 3

The body fans a (1024, D) input out to a (1024, D, 256) activation (``x[..., None] * w``,
elementwise: the step's time is memory, not matrix math); the head scales it and the
loss is its mean square. A split step moves the activation here and its gradient back:
twice the activation's bytes, on top of the input.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch reads this once, at its first allocation: large tensors received here (the
# activation) land in huge pages, as a worker's do (--no-thp: 4 KB pages)
if "--no-thp" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from torch import nn  # noqa: E402

from somatize import Graph  # noqa: E402
from somatize.torch import Split, Trainer, node, parameters  # noqa: E402

FAN = 256


class Fan(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, FAN))

    def forward(self, x):
        return x[..., None] * self.w


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.9))

    def forward(self, y):
        return y * self.s


def objective(y, _target):
    return y.square().mean()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="the activation's size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps a round, after one")
    ap.add_argument("--no-thp", action="store_true",
                    help="tensors received here in 4 KB pages (no THP_MEM_ALLOC_ENABLE)")
    args = ap.parse_args()
    d = args.mib * (1 << 20) // (4 * FAN * 1024)
    data = [(torch.randn(1024, d, generator=torch.Generator().manual_seed(i)), None)
            for i in range(args.steps + 1)]
    lr = 1e-3

    torch.manual_seed(0)
    whole = Graph.somatize(node(Fan()).named("body") >> node(Scale()).named("head"))
    one = Trainer(whole, objective, torch.optim.SGD(parameters(whole), lr=lr))
    torch.manual_seed(0)
    far = Graph.somatize(node(Fan()).named("body").at("gpu") >> node(Scale()).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=lr)}
    split = Trainer(far, objective, torch.optim.SGD(parameters(far, without=trains), lr=lr),
                    trains=trains)
    one.step(data[0])
    split.step(data[0])  # the worker started (each trainer one step: the same weights)
    name = split.runtime.peers["gpu"].name
    act = torch.randn(1024, d, FAN)

    def floor():  # the activation's bytes one way, bare (TensorPipe's own floor)
        rpc.rpc_sync(name, len, args=(act,))

    rows: dict[str, list[float]] = {"one piece": [], "split": [], "bare rpc_sync one way": []}
    losses: dict[str, list[float]] = {"one piece": [], "split": []}
    for _ in range(args.rounds):
        for label, trainer in (("one piece", one), ("split", split)):
            trainer.step(data[0])
            times = []
            for b in data[1:]:
                t = time.perf_counter()
                losses[label].append(trainer.step(b))
                times.append(time.perf_counter() - t)
            rows[label].append(statistics.median(times) * 1e3)
        floor()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            floor()
            times.append(time.perf_counter() - t)
        rows["bare rpc_sync one way"].append(statistics.median(times) * 1e3)
    split.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"$ {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"activation {args.mib} MiB (1024 x {d} x {FAN} float32), {args.rounds} alternated "
          f"rounds of {args.steps} steps, threads {torch.get_num_threads()}, "
          f"THP_MEM_ALLOC_ENABLE here {os.environ.get('THP_MEM_ALLOC_ENABLE', '(unset)')}, "
          f"load {os.getloadavg()[0]:.2f}")
    for k, v in med.items():
        print(f"  {k:26s} {v:9.1f} ms   (rounds: {', '.join(f'{x:.0f}' for x in rows[k])})")
    print(f"  split / one piece {med['split'] / med['one piece']:.3f} (target <= 1.5); "
          f"split - one piece {med['split'] - med['one piece']:.0f} ms against the bare "
          f"activation's bytes there and back, bare, 2 x {med['bare rpc_sync one way']:.0f} ms")
    gib = args.mib / 1024
    print(f"  bare one way: {gib / (med['bare rpc_sync one way'] / 1e3):.2f} GB/s")
    print("  the same losses:", losses["split"] == losses["one piece"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
