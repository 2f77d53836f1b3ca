"""What the drop-in route costs a step, in round trips: the classic autoencoder of
tests/dropin_models.py trained by plain Lightning and under
``SomatizeStrategy(place={"encoder": "worker"})`` in one run, side by side, with a bare
``rpc_sync`` round trip to the same worker measured in the same run.

    python scripts/bench_dropin.py                 # ~1 minute on 2 cores
    python scripts/bench_dropin.py --rounds 9      # steadier on a busy machine
    python scripts/bench_dropin.py --startup --epochs 60   # time to the first batch and
                                                   # the whole fit, each fit a fresh process
    python scripts/bench_dropin.py --memory        # the coordinator's peak memory with a
                                                   # large encoder placed, against plain
    python scripts/bench_dropin.py --clip 0.5      # with norm clipping on both (one more
                                                   # round trip per step: the norms)

The steady step is the median time between consecutive training batches' ends, past
each fit's first epoch (batch 16 of scikit-learn's digits, 113 batches an epoch, no
validation); plain and split fits alternate ``--rounds`` times so both see the same
machine. The overhead is split minus plain, in units of the bare round trip (the
median of ``rpc_sync(worker, noop)`` at each timed epoch's end), each round against its
own plain fit; the median over rounds is reported, with every round's. Also counted: the
messages the strategy sent the worker per step (a call; its backward goes with the next
one), and what one call costs with nothing in it (``runtime.call(worker, id)``: the
function named, the session looked up, the worker's compute thread woken). Beside them,
the cut's own cost with no transport (``cut_cost``: the same steps in plain PyTorch in
this process, whole and cut), and the floor they make: an empty call plus the cut.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# libgomp reads this once, when torch is imported: this process's math threads sleep
# between ops, as the worker's do (somatize starts it so)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.utils.data as tud  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from bench_remote import median_ms  # noqa: E402
from dropin_models import AutoEncoder  # noqa: E402

from somatize.lightning import SomatizeStrategy  # noqa: E402
from somatize.remote import _serve  # noqa: E402


class Clock(pl.Callback):
    """Times between consecutive batches' ends, past the first epoch; for the split fit
    also the bare round trip to the worker and the calls made to it."""

    def __init__(self, repeats: int = 200):
        self.steps: list[float] = []
        self.round_trips: list[float] = []
        self.generic: list[float] = []  # runtime.call of a function that does nothing
        self.calls = 0
        self.batches = 0
        self.repeats = repeats
        self._last: float | None = None
        self._in_step = False

    def on_train_start(self, trainer, pl_module):
        session = getattr(trainer.strategy, "part", lambda _: None)("encoder")
        if session is not None:  # count what the strategy asks of the worker
            runtime = session.runtime
            for name in ("call", "call_async"):  # every message, waited for or not
                setattr(runtime, name, self._counting(getattr(runtime, name)))

    def _counting(self, send):
        def counted(*a, **kw):
            self.calls += self._in_step  # not the syncs at epoch ends
            return send(*a, **kw)

        return counted

    def on_train_epoch_start(self, trainer, pl_module):
        self._last = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._in_step = trainer.current_epoch > 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self._in_step = False
        if trainer.current_epoch > 0:
            self.batches += 1
            if self._last is not None:
                self.steps.append((now - self._last) * 1e3)
        self._last = now

    def on_train_epoch_end(self, trainer, pl_module):
        session = getattr(trainer.strategy, "part", lambda _: None)("encoder")
        if session is None or trainer.current_epoch == 0:
            return
        runtime = session.runtime
        peer = runtime.peers["worker"]
        self.round_trips.append(median_ms(lambda: rpc.rpc_sync(peer.name, _serve.noop),
                                          self.repeats))
        # id(live): a function the worker imports (one defined here would travel by value)
        self.generic.append(median_ms(lambda: runtime.call("worker", id), self.repeats))


def cut_cost(repeats: int = 9) -> float:
    """What cutting the autoencoder costs with no transport at all, in this process (ms a
    step): its steps in plain PyTorch, whole against cut where a placed fit cuts it (the
    encoder's output detached; its backward, Adam step and zero_grad done apart, a step
    late, as the worker does them). Alternated, median of ``repeats``."""
    import torch.nn.functional as F

    x = data().dataset.tensors[0]
    batches = [x[i:i + 16] for i in range(0, len(x) - 15, 16)]

    def whole():
        m = AutoEncoder()
        opt = m.configure_optimizers()["optimizer"]

        def step(b):
            loss = F.mse_loss(m.decoder(m.encoder(b)), b)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return step

    def cut():
        m = AutoEncoder()
        enc = torch.optim.Adam(m.encoder.parameters(), lr=3e-3)
        dec = torch.optim.Adam(m.decoder.parameters(), lr=1e-3)
        late: list = []  # the encoder's output and its gradient, for the next step

        def step(b):
            if late:  # over there: the last step's backward and step, then this forward
                out, grad = late.pop()
                out.backward(grad)
                enc.step()
                enc.zero_grad()
            out = m.encoder(b)
            h = out.detach().requires_grad_()
            loss = F.mse_loss(m.decoder(h), b)
            dec.zero_grad()
            loss.backward()
            dec.step()
            late.append((out, h.grad))
        return step

    def ms(make) -> float:
        torch.manual_seed(0)
        step = make()
        for b in batches[:20]:
            step(b)
        t = time.perf_counter()
        for b in batches:
            step(b)
        return (time.perf_counter() - t) / len(batches) * 1e3

    got = [(ms(whole), ms(cut)) for _ in range(repeats)]
    return statistics.median(c - w for w, c in got)


def wake_us(n: int = 100) -> float:
    """How long a thread takes to run again once another releases the lock it waits on
    (after 5 ms asleep, as a worker's threads sleep between calls), median in us: what
    each hand-off between threads costs here. A bare rpc_sync wakes a few threads on
    each side; a placed call two more over there (the compute thread, and back), and one
    more here (an interruptible wait)."""
    import threading

    def release(lock, at):
        time.sleep(0.005)
        at[0] = time.perf_counter()
        lock.release()

    got = []
    for _ in range(n):
        lock, at = threading.Lock(), [0.0]
        lock.acquire()
        t = threading.Thread(target=release, args=(lock, at))
        t.start()
        lock.acquire()
        got.append(time.perf_counter() - at[0])
        t.join()
    return statistics.median(got) * 1e6


def data() -> tud.DataLoader:
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
    return tud.DataLoader(tud.TensorDataset(x), batch_size=16)


def fit(strategy, epochs: int, **kw) -> Clock:
    clock = Clock()
    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=epochs, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0, callbacks=[clock],
                         **kw)
    trainer.fit(AutoEncoder(), data())
    return clock


class FirstBatch(pl.Callback):
    """When the first training batch starts."""

    def __init__(self):
        self.at = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at is None:
            self.at = time.perf_counter()


def one(which: str, epochs: int) -> None:
    """A whole fit in this (fresh) process: seconds to the first batch and to the end,
    counted from the Trainer's construction (the worker's start is in it)."""
    import json

    from somatize.remote._forks import ForkServer

    first = FirstBatch()
    waited = [0.0]  # in the fork server's ready(): it imports what a worker needs
    ready = ForkServer.ready

    def timed(server):
        t = time.perf_counter()
        try:
            return ready(server)
        finally:
            waited[0] += time.perf_counter() - t

    ForkServer.ready = timed
    t0 = time.perf_counter()
    strategy = "auto" if which == "plain" else SomatizeStrategy(place={"encoder": "worker"})
    trainer = pl.Trainer(max_epochs=epochs, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0, callbacks=[first])
    pl.seed_everything(0)
    trainer.fit(AutoEncoder(), data())
    from somatize.remote._fork_here import current

    print(json.dumps({"first": first.at - t0, "whole": time.perf_counter() - t0,
                      "server": waited[0], "here": current() is not None}))


# what a worker holds before it builds an optimizer (the fork server imports it at start)
_WORKER_IMPORTS = "import torch, torch.distributed.rpc, torch._dynamo"


def fresh_imports() -> float:
    """Seconds a fresh interpreter takes to import what a worker needs: the floor of an
    embedded worker's start in a process that has none yet."""
    import subprocess

    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", _WORKER_IMPORTS], check=True,
                   env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    return time.perf_counter() - t


class Big(pl.LightningModule):
    """An autoencoder whose encoder is large (6 x 2048 x 2048, ~25M parameters, 100 MB)
    trained with Adam: plain Lightning holds its weights, gradients and Adam's two
    moments here; placed, the copy here holds the weights only."""

    def __init__(self):
        super().__init__()
        layers = [torch.nn.Linear(64, 2048)]
        for _ in range(6):
            layers += [torch.nn.ReLU(), torch.nn.Linear(2048, 2048)]
        self.encoder = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(2048, 8))
        self.decoder = torch.nn.Linear(8, 64)

    def training_step(self, batch, i):
        x = batch[0]
        return torch.nn.functional.mse_loss(self.decoder(self.encoder(x)), x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def peak(which: str) -> None:
    """One fit of ``Big`` in this (fresh) process; its peak resident memory."""
    import json
    import resource

    strategy = "auto" if which == "plain" else SomatizeStrategy(place={"encoder": "worker"})
    trainer = pl.Trainer(max_steps=5, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(Big(), data())
    print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def memory() -> int:
    import json
    import subprocess

    got = {}
    for which in ("plain", "split"):
        done = subprocess.run([sys.executable, __file__, "--peak", which], capture_output=True,
                              text=True, timeout=900)
        got[which] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mb"]
    params = sum(p.numel() for p in Big().encoder.parameters())
    print(f"$ {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"encoder of {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB), Adam; "
          "the coordinator's peak resident memory:")
    print(f"  plain Lightning {got['plain']:8.0f} MB (weights, gradients, Adam's moments here)")
    print(f"  encoder placed  {got['split']:8.0f} MB (the copy here: weights only)")
    print(f"  saved           {got['plain'] - got['split']:8.0f} MB")
    return 0


def startup(args) -> int:
    import json
    import subprocess

    got = {"plain": [], "split": []}
    floor = []
    for _ in range(args.rounds):
        for which in ("plain", "split"):
            done = subprocess.run([sys.executable, __file__, "--one", which, "--epochs",
                                   str(args.epochs)], capture_output=True, text=True,
                                  timeout=1800)
            got[which].append(json.loads(done.stdout.strip().splitlines()[-1]))
        floor.append(fresh_imports())
    med = {w: {k: statistics.median(r[k] for r in rs) for k in ("first", "whole", "server")}
           for w, rs in got.items()}
    print(f"$ {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"autoencoder, {args.epochs} epochs a fit, {args.rounds} rounds, each fit a fresh "
          f"process (torch imported before the clock starts), load {os.getloadavg()[0]:.2f}")
    for k, label in (("first", "to the first batch"), ("whole", "the whole fit")):
        p, s = med["plain"][k], med["split"][k]
        print(f"{label:>20}: plain {p:7.2f} s, split {s:7.2f} s, ratio {s / p:5.2f}"
              + ("   (target <= 1.15)" if k == "whole" else "   (target <= 0.5 s)"))
    here = sum(r.get("here", False) for r in got["split"])
    print(f"  of the split's first batch, waiting for the fork server to be ready: "
          f"{med['split']['server']:.2f} s (forked from the coordinator in {here} of "
          f"{len(got['split'])} fits); a fresh `python -c \"{_WORKER_IMPORTS}\"` "
          f"here: {statistics.median(floor):.2f} s (every round: "
          f"{', '.join(f'{f:.2f}' for f in floor)})")
    steps = args.epochs * len(data())
    per = {w: (med[w]["whole"] - med[w]["first"]) / steps * 1e3 for w in med}
    print(f"  after the first batch, {steps} steps: plain {per['plain']:.2f} ms a step, split "
          f"{per['split']:.2f} ms; the whole fit within 1.15x plain leaves the split "
          f"{0.15 * med['plain']['whole']:.2f} s for its start and all its messages")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3, help="per fit; the first is not timed")
    ap.add_argument("--rounds", type=int, default=5, help="plain and split fits, alternated")
    ap.add_argument("--startup", action="store_true",
                    help="time to the first batch and the whole fit, fresh processes")
    ap.add_argument("--one", choices=["plain", "split"], help=argparse.SUPPRESS)
    ap.add_argument("--memory", action="store_true",
                    help="the coordinator's peak memory, a large encoder placed vs plain")
    ap.add_argument("--peak", choices=["plain", "split"], help=argparse.SUPPRESS)
    ap.add_argument("--clip", type=float, default=None,
                    help="both fits with gradient_clip_val (norm): the norms over there cost "
                         "one more round trip per step")
    args = ap.parse_args()
    if args.peak:
        peak(args.peak)
        return 0
    if args.memory:
        return memory()
    if args.one:
        one(args.one, args.epochs)
        return 0
    if args.startup:
        return startup(args)
    rounds = []  # per round: plain ms/step, split ms/step, round trip ms, empty call ms
    calls = batches = 0
    clip = {} if args.clip is None else {"gradient_clip_val": args.clip}
    for _ in range(args.rounds):
        plain = fit("auto", args.epochs, **clip)
        split = fit(SomatizeStrategy(place={"encoder": "worker"}), args.epochs, **clip)
        rounds.append([statistics.median(x) for x in (plain.steps, split.steps,
                                                       split.round_trips, split.generic)])
        calls, batches = calls + split.calls, batches + split.batches
    p, s, rt, g = (statistics.median(r[i] for r in rounds) for i in range(4))
    cut, wake = cut_cost(), wake_us()
    over = sorted((r[1] - r[0]) / r[2] for r in rounds)  # each round against its own
    print(f"$ {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"autoencoder (tests/dropin_models.py), batch 16, {args.rounds} rounds of "
          f"{args.epochs - 1} timed epochs each; math threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} cores, OMP_WAIT_POLICY {os.environ['OMP_WAIT_POLICY']}, "
          f"load {os.getloadavg()[0]:.2f}")
    if clip:
        print(f"gradient_clip_val={args.clip} (norm) on both: one more round trip per step is "
              "expected (the placed gradients' norms, read before the step)")
    print(f"{'plain Lightning':>34}: {p:7.3f} ms/step")
    print(f"{'SomatizeStrategy(place=encoder)':>34}: {s:7.3f} ms/step")
    print(f"{'bare rpc_sync round trip':>34}: {rt:7.3f} ms")
    print(f"{'overhead':>34}: {s - p:7.3f} ms/step = {statistics.median(over):.2f} round trips "
          f"(median of the rounds: {', '.join(f'{o:.2f}' for o in over)}; target <= "
          f"{2.5 if clip else 1.5})")
    print(f"{'messages to the worker':>34}: {calls / max(batches, 1):.2f} per step; an empty call "
          f"(runtime.call) costs {g:.3f} ms = {g / rt:.2f} round trips")
    floor = g / rt + cut / rt
    print(f"{'a thread woken here':>34}: {wake:7.0f} us (a lock released by another thread; "
          "an empty call wakes three more threads than a bare rpc_sync)")
    print(f"{'the cut alone, no transport':>34}: {cut:7.3f} ms/step = {cut / rt:.2f} round trips "
          "(this process, plain PyTorch: the encoder's backward and Adam step apart)")
    print(f"{'floor of this design':>34}: {floor:.2f} round trips (an empty call + the cut); "
          f"over it: {statistics.median(over) - floor:.2f} (somatize's own work a step on both "
          "sides, the call's tensors and ops, and the worker's ops run after it idled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
