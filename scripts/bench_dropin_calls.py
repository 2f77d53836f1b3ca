"""What a placed step costs in Python, counted rather than timed: the autoencoder of
scripts/bench_dropin.py fitted by a real ``lightning.Trainer`` under
``SomatizeStrategy(place={"encoder": "worker"})``, and ``cProfile`` around ``--steps``
steady training steps (Lightning's loop, the call over there and its backward, the
optimizer's step), on the coordinator and, in the same steps, on the worker's compute
thread. The number of Python function calls per step does not move with the machine's
load, so two checkouts can be compared where wall time cannot tell a few percent apart.
Run it from the root of the checkout to measure (its ``somatize`` and its scripts/ are
used):

    cd CHECKOUT && PYTHONPATH=. .venv/bin/python /path/to/scripts/bench_dropin_calls.py
    ... bench_dropin_calls.py --structured       # the encoder takes and gives a structure
    ... bench_dropin_calls.py --top 15           # and somatize's 15 most called here
    ... bench_dropin_calls.py --plain            # and plain Lightning's step beside it

``--structured`` wraps the encoder so its call takes a keyword dict and answers a dict:
the path on which the call's structure travels pickled. Prints the calls per step on
each side, and the profiled milliseconds per step here (waits included: those move with
the load).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_dropin.py (before torch)
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "scripts")]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import somatize  # noqa: E402

if not os.path.abspath(somatize.__file__).startswith(os.getcwd() + os.sep):
    sys.exit(f"somatize imported from {somatize.__file__}, not from this checkout "
             f"({os.getcwd()}): run with PYTHONPATH=.")

from bench_dropin import AutoEncoder, data  # noqa: E402

from somatize.lightning import SomatizeStrategy  # noqa: E402


class Keyed(torch.nn.Module):
    """The encoder, called with a keyword dict and answering a dict (pickled structure)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, extra=None):
        return {"z": self.inner(x) * extra["scale"], "n": x.shape[0]}


class Structured(AutoEncoder):
    def __init__(self):
        super().__init__()
        self.encoder = Keyed(self.encoder)

    def training_step(self, batch, i):
        x = batch[0]
        z = self.encoder(x, extra={"scale": 1.0})["z"]
        loss = torch.nn.functional.mse_loss(self.decoder(z), x)
        self.log("loss", loss)
        return loss


# over there (sent by value): the worker's compute thread profiles what it runs between
def _start(live) -> None:
    sys.bench_profile = cProfile.Profile()  # (no module of ours lives over there)
    sys.bench_profile.enable()


def _stop(live) -> tuple[int, int]:
    sys.bench_profile.disable()
    return _counts(pstats.Stats(sys.bench_profile))


def _counts(stats: pstats.Stats) -> tuple[int, int]:
    # every call, and the calls of somatize's own functions (those a change to it moves)
    own = sum(nc for (path, _, _), (_, nc, *_) in stats.stats.items()
              if f"{os.sep}somatize{os.sep}" in path)
    return stats.total_calls, own


class Counted(pl.Callback):
    """Profiles the steps ``first`` to ``first + steps`` (each from its batch's start)."""

    def __init__(self, first: int, steps: int):
        self.first, self.steps = first, steps
        self.profile = cProfile.Profile()
        self.there: tuple[int, int] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        part_of = getattr(trainer.strategy, "part", None)  # (None: plain Lightning)
        part = part_of("encoder") if part_of is not None else None
        if batch_idx == self.first:
            if part is not None:
                part.call("worker", _start)
            self.profile.enable()
        elif batch_idx == self.first + self.steps:
            self.profile.disable()
            if part is not None:  # after the last step's backward there
                self.there = part.call("worker", _stop)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--structured", action="store_true",
                    help="the encoder takes a keyword dict and answers a dict")
    ap.add_argument("--plain", action="store_true",
                    help="also count plain Lightning's step (no strategy), the same model")
    ap.add_argument("--top", type=int, default=0,
                    help="print somatize's N most called functions here")
    args = ap.parse_args()
    loader = data()
    if args.warmup + args.steps >= len(loader):
        sys.exit(f"--warmup + --steps must stay below the {len(loader)} batches of an epoch")
    counted = Counted(args.warmup, args.steps)
    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=1, strategy=SomatizeStrategy(place={"encoder": "worker"}),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0,
                         limit_train_batches=args.warmup + args.steps + 1, callbacks=[counted])
    trainer.fit(Structured() if args.structured else AutoEncoder(), loader)
    stats = pstats.Stats(counted.profile)
    (here, own), (there, own_there) = _counts(stats), counted.there
    n = args.steps
    kind = "structured" if args.structured else "tensor"
    print(f"{os.getcwd()}: Python calls per placed step ({kind} call): here {here / n:.1f} "
          f"({own / n:.1f} in somatize), on the worker {there / n:.1f} ({own_there / n:.1f} "
          f"in somatize); {stats.total_tt / n * 1e3:.2f} ms per step profiled here "
          "(waits included)")
    if args.plain:
        plain = Counted(args.warmup, args.steps)
        pl.seed_everything(0)
        pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False,
                   limit_val_batches=0, limit_train_batches=args.warmup + args.steps + 1,
                   callbacks=[plain]).fit(Structured() if args.structured else AutoEncoder(),
                                          loader)
        alone = pstats.Stats(plain.profile).total_calls / n
        print(f"plain Lightning's step, the same model: {alone:.1f} calls here; the placed "
              f"step's {here / n - alone:.1f} more are {(here / n - alone) / (here / n):.1%} "
              "of it")
        if args.top:  # the functions called more often a step than plain Lightning calls them
            mine, theirs = stats.stats, pstats.Stats(plain.profile).stats
            grew = sorted(((mine[f][1] - theirs.get(f, (0, 0))[1], f) for f in mine),
                          reverse=True)[:args.top]
            print("called more often a step than in plain Lightning's step:")
            for d, (path, line, fn) in grew:
                print(f"  {d / n:7.1f}  {fn} ({path.rsplit(os.sep, 2)[-2:]}:{line})")
    if args.top:
        stats.sort_stats("ncalls").print_stats(f"{os.sep}somatize{os.sep}", args.top)


if __name__ == "__main__":
    main()
