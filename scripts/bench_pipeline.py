"""Two one-core "hosts": the same MLP trained in one piece on one core, and split across
a worker on a second core, whole batches (k=1) and in micro-batches (k=4, 1F1B), side
by side in one run.

    python scripts/bench_pipeline.py                    # cores 0 and 1, 3 x 8 steps, batch 1024
    python scripts/bench_pipeline.py --cores 2,3 --steps 12 --repeats 5 --wire
    python scripts/bench_pipeline.py --wait 0.05        # halves that sleep instead of multiplying
    sudo .venv/bin/python scripts/bench_pipeline.py --link 1gbit   # also over a 1 Gbit/s link

Each process is pinned to its own core (every thread of it, ``os.sched_setaffinity``)
with one math thread (``torch.set_num_threads(1)``, ``Worker.embedded(threads=1)``); the
worker is pinned by its pid once it has started (nothing in somatize pins it). The body
(1024->1024->1024, ReLU) and the head (1024->1024->1024->10) cost about the same, so two
cores can at best halve a step. Prints milliseconds per step and the ratio to one piece,
then where the time of a split step goes: the body and the head alone on one core, the
best a k-piece pipeline can do with them, a bare round trip, and whether the two cores
compute at once at all (two vCPUs of a VM may share one physical core: then no split
beats one piece, and ``--wait`` shows the schedule on halves that share nothing).

``--link RATE`` (as root, with ``ip`` and ``tc``) runs it all again between two test hosts
(network namespaces, ``tests/hosts.py``, 198.18.0.1 and .2) whose links are shaped to RATE
each way (``tc qdisc replace dev veth-X root tbf rate RATE burst 256kb latency 50ms``; a
32kbit burst gets only ~85 MB/s of a 1gbit link on this kernel): the coordinator on host a,
the body on a standing worker (``python -m somatize.worker``, ``Worker.at``) on host b,
pinned as above. Every split runs both ways in turn, step by step: over loopback (an
embedded worker on host a) and over the link, with and without ``wire=torch.bfloat16``,
and prints the bytes each link step moved and what they cost at the rate measured by a
bare TCP transfer. The hosts, and whatever runs on them, are removed on exit (Ctrl-C or
an error too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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


def trainer(k: int | None, wire: torch.dtype | None = None, wait: float = 0.0,
            at: str | None = None) -> Trainer:
    """One piece here (``k=None``), or the body on the worker (embedded here, or the
    standing one at ``at``), in ``k`` micro-batches."""
    g = graph(None if k is None else "gpu", wait)
    if k is None:
        return Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g), lr=LR))
    trains = {"body": Split(torch.optim.SGD, lr=LR, wire=wire)}
    w = Worker.embedded(threads=1) if at is None else Worker.at(at, threads=1, timeout=120)
    return Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=LR),
                   trains=trains, workers={"gpu": w}, micro_batches=k)


LINK = "link: "  # names of the runs over the shaped link


def link_bytes() -> tuple[int, int]:
    """Bytes this host's link (veth-*, ``tests/hosts.py``) has sent and received so far."""
    n = [0, 0]
    for iface in os.listdir("/sys/class/net"):
        if iface.startswith("veth-"):
            for i, way in enumerate(("tx", "rx")):
                with open(f"/sys/class/net/{iface}/statistics/{way}_bytes") as f:
                    n[i] += int(f.read())
    return n[0], n[1]


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
    ap.add_argument("--link", metavar="RATE", default=None,
                    help="also over a link shaped to RATE (e.g. 1gbit) between two network "
                         "namespaces, the worker a standing daemon there (root, ip, tc)")
    ap.add_argument("--multiply-on", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--on-link", default=None, help=argparse.SUPPRESS)  # HERE,THERE:PORT
    ap.add_argument("--rate", default=None, help=argparse.SUPPRESS)  # measured, MB/s
    args = ap.parse_args()
    if args.link and not args.on_link:
        return over_link(args)
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
    if not args.on_link:
        runs = {"one piece, one core": trainer(None, wait=w), "split, k=1": trainer(1, wait=w),
                "split, k=4": trainer(4, wait=w)}
        if args.wire:
            runs["split, k=4, bf16 wire"] = trainer(4, torch.bfloat16, wait=w)
    else:  # every split both ways, with and without the narrow wire
        import somatize.remote

        me, daemon = args.on_link.split(",")
        somatize.remote.configure(listen=me)  # where the worker on the other host reaches us
        splits = {f"split, k={k}{', bf16 wire' if wire else ''}": (k, wire)
                  for k in (1, 4) for wire in (None, torch.bfloat16)}
        runs = {"one piece, one core": trainer(None, wait=w)}
        for name, (k, wire) in splits.items():
            runs[name] = trainer(k, wire, wait=w)
        for name, (k, wire) in splits.items():
            runs[LINK + name] = trainer(k, wire, wait=w, at=daemon)
    for t in runs.values():
        for b in data[:2]:
            timed(t, b)  # warm: the worker is up, its threads made
    worker = next(iter(runs["split, k=1"].where()["body"]))
    pin(worker, there)
    if args.on_link:
        pin(next(iter(runs[LINK + "split, k=1"].where()["body"])), there)
    pin(os.getpid(), here)
    moved: dict[str, list[tuple[int, int]]] = {n: [] for n in runs if n.startswith(LINK)}
    alone = Alone(w)
    ms: dict[str, list[float]] = {name: [] for name in [*runs, "body alone", "head alone"]}
    for _ in range(args.repeats):
        for b in data:  # step by step in turn, so a slow moment of the machine is shared
            for name, t in runs.items():
                n = link_bytes() if name in moved else (0, 0)
                ms[name].append(timed(t, b))
                if name in moved:
                    moved[name].append(tuple(m - k for m, k in zip(link_bytes(), n, strict=True)))
            for name, v in alone(b).items():
                ms[name].append(v)
    med = {name: statistics.median(v) for name, v in ms.items()}
    one = med["one piece, one core"]
    model = (f"MLP {WIDTH}x2 body" if not w else f"body sleeping {w:g} ms/row")
    print(f"{model} on core {there} (worker pid {worker}), head on "
          f"core {here}, batch {args.batch}, SGD, one math thread each; medians of "
          f"{args.repeats} x {args.steps} steps, taken in turn")
    if args.on_link:
        print(f"loopback: an embedded worker on the coordinator's host; link: the standing "
              f"worker on the other host, {args.link} each way (TCP moves "
              f"{float(args.rate):.0f} MB/s over it)")
        print(f"{'run':<24}{'loopback':>10}{'x one':>7}{'link':>10}{'x one':>7}"
              f"{'MB out':>8}{'MB back':>8}{'at rate':>9}{'link-loop':>11}")
        print(f"{'one piece, one core':<24}{one:>10.1f}{1:>7.2f}")
        for name in splits:
            lo, li = med[name], med[LINK + name]
            out, back = (statistics.median(v) / 1e6 for v in zip(*moved[LINK + name], strict=True))
            print(f"{name:<24}{lo:>10.1f}{lo / one:>7.2f}{li:>10.1f}{li / one:>7.2f}"
                  f"{out:>8.2f}{back:>8.2f}{(out + back) / float(args.rate) * 1e3:>9.1f}"
                  f"{li - lo:>11.1f}")
        print("(ms per step; MB out / back: what the coordinator's link sent to / received "
              "from the worker's per step, headers included; at rate: both one after the "
              "other at the measured rate)")
    else:
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


_RECEIVE = r"""
import socket, sys, time
s = socket.create_server((sys.argv[1], 7100)); s.settimeout(60)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(60); buf = bytearray(1 << 20); n, t0 = 0, None
while k := c.recv_into(buf):
    t0 = t0 or time.perf_counter(); n += k
print(n / (time.perf_counter() - t0) / 1e6, flush=True)
"""
_SEND = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], 7100), timeout=60); b = bytes(1 << 20)
for _ in range(64): c.sendall(b)
c.close()
"""


def throughput(src, dst) -> float:
    """MB/s of a bare TCP transfer of 64 MB from host ``src`` to host ``dst``."""
    r = dst.popen([sys.executable, "-c", _RECEIVE, dst.addr], stdout=subprocess.PIPE, text=True)
    try:
        if r.stdout.readline().strip() != "ready":
            raise RuntimeError("the receiver did not start")
        src.run([sys.executable, "-c", _SEND, dst.addr], timeout=60, check=True)
        return float(r.communicate(timeout=60)[0])
    finally:
        r.kill()
        r.wait(timeout=10)


def losses(host) -> str:
    """Packets the host's token bucket dropped and TCP segments it sent again, so far."""
    import re

    tc = subprocess.run(["tc", "-n", host.ns, "-s", "qdisc", "show", "dev", host.iface],
                        capture_output=True, text=True, timeout=30).stdout
    dropped = re.search(r"dropped (\d+)", tc)
    tcp = [line.split()[1:] for line in host.run(["cat", "/proc/net/snmp"], timeout=30)
           .stdout.splitlines() if line.startswith("Tcp:")]
    resent = dict(zip(*tcp, strict=True)).get("RetransSegs", "?") if len(tcp) == 2 else "?"
    return (f"host {host.name} sent {host.counters()['tx'] / 1e6:.0f} MB, its tbf dropped "
            f"{dropped.group(1) if dropped else '?'} packets, TCP resent {resent} segments")


def over_link(args) -> int:
    """Hosts a and b with their links shaped to ``args.link``, a standing worker on b
    pinned to the worker's core, and this script again on a as the coordinator; all of it
    removed at the end, whatever happens."""
    import signal
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from hosts import Hosts, HostsError

    here, there = (int(c) for c in args.cores.split(","))

    def stop(signum, frame):  # SIGTERM, SIGHUP: clean up as on Ctrl-C
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        hosts = Hosts("a", "b").up()
    except HostsError as e:
        print(f"--link needs test hosts: {e}", file=sys.stderr)
        return 1
    try:
        a, b = hosts["a"], hosts["b"]
        for h in (a, b):
            h.shape(args.link)
        rate = statistics.median([throughput(a, b), throughput(b, a)])
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "daemon.log")
            with open(log, "w") as out:
                daemon = b.popen(["taskset", "-c", str(there), sys.executable, "-m",
                                  "somatize.worker", "--name", "gpu", "--listen",
                                  f"{b.addr}:7000"], stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while "listening on" not in open(log).read():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the standing worker did not start:\n{open(log).read()}")
                time.sleep(0.05)
            argv = [a for a in sys.argv[1:]]
            coordinator = a.popen(["taskset", "-c", str(here), sys.executable,
                                   os.path.abspath(__file__), *argv, "--on-link",
                                   f"{a.addr},{b.addr}:7000", "--rate", f"{rate:.1f}"])
            # each step of 9 runs well under 5 s on these cores, warm-up and start included
            limit = 120 + 9 * 5 * (args.repeats * args.steps + 2)
            try:
                rc = coordinator.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                print(f"the coordinator took more than {limit} s: stopped", file=sys.stderr)
                rc = 1
            if rc:
                print(open(log).read()[-4000:], file=sys.stderr)
            else:
                print(f"\nthe link, over the whole run: {losses(a)}; {losses(b)}")
            return rc
    finally:
        hosts.close()


if __name__ == "__main__":
    sys.exit(main())
