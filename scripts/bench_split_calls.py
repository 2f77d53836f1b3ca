"""What a split step costs the coordinator in Python, counted rather than timed: the
graph of scripts/bench_split.py (the body on a worker, trained by a ``Split``, the head
here), warmed up, then ``cProfile`` around ``--steps`` calls of ``Trainer.step``. The
number of Python function calls per step does not move with the machine's load, so two
checkouts can be compared where wall time cannot tell a few percent apart. Run it from
the root of the checkout to measure (its ``somatize`` and its scripts/ are used):

    cd CHECKOUT && PYTHONPATH=. .venv/bin/python /path/to/scripts/bench_split_calls.py
    ... bench_split_calls.py --steps 100 --top 15      # and the 15 costliest functions

Prints the calls per step, the profiled seconds per step (waits included: those move
with the load), and with ``--top`` the functions with the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_split.py (before torch)
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "scripts")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import somatize  # noqa: E402

if not os.path.abspath(somatize.__file__).startswith(os.getcwd() + os.sep):
    sys.exit(f"somatize imported from {somatize.__file__}, not from this checkout "
             f"({os.getcwd()}): run with PYTHONPATH=.")

from bench_split import LR, fresh  # noqa: E402

from somatize import Graph  # noqa: E402
from somatize.torch import Split, Trainer, node, parameters  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--top", type=int, default=0, help="print the N costliest functions")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(256, 784, generator=gen), torch.randint(0, 10, (256,), generator=gen))
            for _ in range(args.warmup + args.steps)]
    mlp, head = fresh()
    far = Graph.somatize(node(mlp).named("body").at("gpu") >> node(head).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=LR)}
    split = Trainer(far, F.cross_entropy,
                    torch.optim.SGD(parameters(far, without=trains), lr=LR), trains=trains)
    try:
        for batch in data[:args.warmup]:
            split.step(batch)
        profile = cProfile.Profile()
        profile.enable()
        for batch in data[args.warmup:]:
            split.step(batch)
        profile.disable()
    finally:
        split.close()
    stats = pstats.Stats(profile)
    print(f"{os.getcwd()}: {stats.total_calls / args.steps:.1f} Python calls per split step "
          f"({stats.prim_calls / args.steps:.1f} primitive), "
          f"{stats.total_tt / args.steps * 1e3:.2f} ms per step profiled (waits included)")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
