"""What an embedded worker costs to start, afresh and forked from a warm server
(``somatize.remote.fork_workers``), the two alternated in one run: the wall time of a
graph's first forward (the worker's start is in it), and the CPU time the worker had
spent by then, and once it built an optimizer (which imports torch's compiler modules).

    python scripts/bench_workers.py              # 5 rounds, ~1 minute on 2 cores
    python scripts/bench_workers.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from somatize import Graph
from somatize.remote import fork_workers, runtime_for
from somatize.remote._forks import FORKS_ENV
from somatize.torch import node


def _cpu(live, optimizer: bool) -> float:
    import resource

    import torch

    if optimizer:
        torch.optim.SGD(live["linear"].module.parameters(), lr=0.1)
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def once() -> tuple[float, float, float]:
    """One worker started, used and closed: (first forward s, its CPU s, CPU s once it
    built an optimizer)."""
    g = Graph.somatize(node(torch.nn.Linear(4, 4)).at("w"))
    began = time.perf_counter()
    g.forward(torch.ones(2, 4))
    wall = time.perf_counter() - began
    rt = runtime_for(g)
    cpu, with_optimizer = rt.call("w", _cpu, False), rt.call("w", _cpu, True)
    g.close()
    return wall, cpu, with_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    began = time.perf_counter()
    server = fork_workers()
    print(f"fork server ready in {time.perf_counter() - began:.2f} s (once per session)")
    path = os.environ[FORKS_ENV]
    got: dict[str, list] = {"fresh": [], "forked": []}
    for _ in range(args.rounds):
        for how in got:  # alternated: both see the same machine
            if how == "fresh":
                os.environ.pop(FORKS_ENV)
            else:
                os.environ[FORKS_ENV] = path
            got[how].append(once())
    server.close()
    print(f"medians over {args.rounds} workers each (load {os.getloadavg()[0]:.1f}):")
    med = {how: [statistics.median(r[i] for r in rows) for i in range(3)]
           for how, rows in got.items()}
    for i, what in enumerate(("first forward (wall s)", "worker CPU s by then",
                              "worker CPU s with an optimizer")):
        print(f"  {what:32s} fresh {med['fresh'][i]:6.2f}  forked {med['forked'][i]:6.2f}  "
              f"fresh/forked {med['fresh'][i] / med['forked'][i]:5.1f}x")


if __name__ == "__main__":
    main()
