"""Split learning on loopback, side by side in one run: the same MLP trained in one piece
here, trained by somatize with its body on a local worker (``Split``), and trained the
torch-native way (RemoteModule + distributed autograd + DistributedOptimizer).

    python scripts/bench_split.py              # medians of 5 repeats of 20 steps
    python scripts/bench_split.py --repeats 3 --steps 5
    python scripts/bench_split.py --spin       # this process's math threads busy-wait

Body 784->1024->1024 (ReLU between), head 1024->10 here, batch 256, SGD. Prints
milliseconds per step, the ratios, and a breakdown of what a split step costs beyond
the compute: a bare round trip, and moving the step's tensors there and back.

The worker's math threads sleep when idle (somatize starts it with
``OMP_WAIT_POLICY=PASSIVE``); this process's do too unless ``--spin``, as a user's
process does when started with ``OMP_WAIT_POLICY=PASSIVE`` (it must be set before torch
is imported). On a machine whose cores the coordinator and its worker share, a team left
busy-waiting on one side slows the other side's compute: see the two settings printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# libgomp reads this once, when torch is imported: this process's math threads sleep
# between ops, as the workers' do (somatize starts them so), unless --spin keeps libgomp's
# default (busy-waiting ~3 ms after each op, on the cores the worker computes on)
if "--spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch reads this once, at its first allocation: large tensors received here land in
# huge pages, as a worker's do (--no-thp: 4 KB pages; docs/performance.md)
if "--no-thp" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from somatize import Graph  # noqa: E402
from somatize.torch import Split, Trainer, node, parameters  # noqa: E402

LR = 0.01


def fresh():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())
    return mlp, nn.Linear(1024, 10)


def timed(step, data, warmup=2) -> tuple[float, list[float]]:
    """Median ms per step over ``data`` after ``warmup`` steps, and the losses."""
    losses = [step(b) for b in data[:warmup]]
    times = []
    for b in data[warmup:]:
        t0 = time.perf_counter()
        losses.append(step(b))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), losses


def native(remote_name: str, data):
    """RemoteModule + dist_autograd + DistributedOptimizer over the same worker."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef

    mlp, head = fresh()
    body = RemoteModule(f"{remote_name}/cpu", nn.Sequential,
                        args=tuple(mlp))  # the same modules, same weights, pickled there
    opt = DistributedOptimizer(torch.optim.SGD, body.remote_parameters()
                               + [RRef(p) for p in head.parameters()], lr=LR)

    def step(batch):
        x, y = batch
        with dist_autograd.context() as cid:
            loss = F.cross_entropy(head(body(x)), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        return loss.item()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--spin", action="store_true", help="keep libgomp's busy-wait here")
    ap.add_argument("--no-thp", action="store_true",
                    help="tensors received here in 4 KB pages (no THP_MEM_ALLOC_ENABLE)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1)
    n = args.steps + 2
    data = [(torch.randn(256, 784, generator=gen), torch.randint(0, 10, (256,), generator=gen))
            for _ in range(n)]

    mlp, head = fresh()
    whole = Graph.somatize(node(mlp).named("body") >> node(head).named("head"))
    one = Trainer(whole, F.cross_entropy, torch.optim.SGD(parameters(whole), lr=LR))

    mlp, head = fresh()
    far = Graph.somatize(node(mlp).named("body").at("gpu") >> node(head).named("head"))
    trains = {"body": Split(torch.optim.SGD, lr=LR)}
    split = Trainer(far, F.cross_entropy, torch.optim.SGD(parameters(far, without=trains),
                                                          lr=LR), trains=trains)
    rt = split.runtime
    name = rt.peers["gpu"].name
    nat = native(name, data)

    # the breakdown: a bare round trip, and the step's tensors there and back
    def noop():
        rt.call("gpu", _nothing)

    x, _ = data[0]
    act = torch.randn(256, 1024)

    def move():  # what a step moves: the input and a gradient there, an activation back
        rt.call("gpu", _echo, x, act)

    m, _ = fresh()

    def body_step():  # the worker's compute, measured here with the same threads
        m(x).backward(act)

    rows = {"one piece": [], "somatize split": [], "torch native": [], "round trip": [],
            "tensors moved": [], "body fwd+bwd": []}
    losses = {}
    for r in range(args.repeats):
        for label, step in (("one piece", one.step), ("somatize split", split.step),
                            ("torch native", nat)):
            ms, got = timed(step, data)
            rows[label].append(ms)
            if r == 0:
                losses[label] = got
        for label, fn in (("round trip", noop), ("tensors moved", move),
                          ("body fwd+bwd", body_step)):
            ms, _ = timed(lambda _b, fn=fn: fn(), list(range(12)))
            rows[label].append(ms)
    split.flush()
    crit, away = timeline(split, data, args.repeats)

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"$ {' '.join(sys.argv)}")
    print(f"threads {torch.get_num_threads()}, repeats {args.repeats} x {args.steps} steps, "
          f"OMP_WAIT_POLICY here {os.environ.get('OMP_WAIT_POLICY', '(libgomp default)')}, "
          f"on the worker {_there(rt, 'OMP_WAIT_POLICY')}, load {os.getloadavg()[0]:.2f}")
    for k, v in med.items():
        print(f"  {k:16s} {v:7.2f} ms   (runs: {', '.join(f'{x:.1f}' for x in rows[k])})")
    # each repeat's pair, run one after the other: the machine's drift between repeats
    # (this VM's speed moves by 20% from second to second) cancels in it
    pairs = [s / o for o, s in zip(rows["one piece"], rows["somatize split"], strict=True)]
    ratio = statistics.median(pairs)
    print(f"  split / one piece   {ratio:.3f}   (target <= 1.10; the median of each repeat's "
          f"pair: {', '.join(f'{q:.3f}' for q in pairs)}; of the medians "
          f"{med['somatize split'] / med['one piece']:.3f})")
    print(f"  native / one piece  {med['torch native'] / med['one piece']:.3f}")
    print(f"  split / native      {med['somatize split'] / med['torch native']:.3f}   "
          "(target <= 1)")
    print(f"  split - one piece   {med['somatize split'] - med['one piece']:.2f} ms per step "
          f"(one round trip per step: step k's gradient rides with step k+1's input)")
    print(f"  coordinator, answer -> next request {crit:.2f} ms (head, loss, backward, the "
          f"next step's request); request -> answer {away:.2f} ms")
    print("  bit-identical losses: split", losses["somatize split"] == losses["one piece"],
          "native", losses["torch native"] == losses["one piece"])
    split.close()


def timeline(trainer, data, repeats: int) -> tuple[float, float]:
    """Median ms from a stretch's answer to the next step's request (what the coordinator
    adds to the critical path), and from a request to its answer (transfer and the worker)."""
    rt = trainer.runtime
    marks: list[tuple[str, float]] = []
    submit = rt.submit

    class Timed:  # the pending stretch, marking when its answer is in
        def __init__(self, pending):
            self.pending = pending

        def result(self):
            got = self.pending.result()
            marks.append(("answer", time.perf_counter()))
            return got

    def timed_submit(stretch):
        pending = submit(stretch)
        marks.append(("request", time.perf_counter()))
        return Timed(pending)

    rt.submit = timed_submit  # this run's runtime only
    crit, away = [], []
    try:
        for _ in range(repeats):
            marks.clear()
            for batch in data:
                trainer.step(batch)
            after = marks[4:]  # after 2 warm-up steps
            for (what, t0), (_, t1) in zip(after, after[1:], strict=False):
                (crit if what == "answer" else away).append((t1 - t0) * 1e3)
    finally:
        del rt.submit
    return statistics.median(crit), statistics.median(away)


def _nothing(live):
    return None


def _there(rt, name):
    return rt.call("gpu", _env, name)


def _env(live, name):
    return os.environ.get(name, "(libgomp default)")


def _echo(live, x, act):
    return act


if __name__ == "__main__":
    main()
