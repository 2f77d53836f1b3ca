"""What a placed step costs in CPU time, on each side: the autoencoder of
scripts/bench_dropin.py trained under ``SomatizeStrategy(place={"encoder": "worker"})``,
and per step of the timed epochs (all but the first) the coordinator's CPU time (the
whole process, and its main thread alone: the Python that drives the step) and the
worker's (its process, read from /proc). CPU time moves much less with the machine's
load than wall time does, so two checkouts can be compared on a shared machine. Run it
from the root of the checkout to measure (its ``somatize`` and its scripts/ are used):

    cd CHECKOUT && PYTHONPATH=. .venv/bin/python /path/to/scripts/bench_dropin_cpu.py
    ... bench_dropin_cpu.py --epochs 6 --rounds 3      # longer, steadier
    ... bench_dropin_cpu.py --profile out.prof         # cProfile of the timed epochs

Prints one JSON line per round, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_dropin.py (before torch)
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "scripts"),
                os.path.join(os.getcwd(), "tests")]

import lightning.pytorch as pl  # noqa: E402

import somatize  # noqa: E402
from somatize.lightning import SomatizeStrategy  # noqa: E402

if not os.path.abspath(somatize.__file__).startswith(os.getcwd() + os.sep):
    sys.exit(f"somatize imported from {somatize.__file__}, not from this checkout "
             f"({os.getcwd()}): run with PYTHONPATH=.")

import bench_dropin  # noqa: E402


def worker_pid(trainer: pl.Trainer) -> int:
    strategy = trainer.strategy
    if hasattr(strategy, "part"):
        return strategy.part("encoder").runtime.peers["worker"].pid
    if hasattr(strategy, "session"):  # a checkout before part(name)
        return strategy.session("encoder").runtime.peers["worker"].pid
    return strategy.dropin.step.runtime.peers["worker"].pid  # a checkout before routes


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class CPU(pl.Callback):
    """CPU time per step over the epochs past the first."""

    def __init__(self, profile=None):
        self.profile, self.steps, self.got = profile, 0, None

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            self.pid = worker_pid(trainer)
            self.start = (time.process_time(), time.thread_time(), cpu_seconds(self.pid),
                          time.perf_counter())
            if self.profile is not None:
                self.profile.enable()

    def on_train_batch_end(self, trainer, *args):
        self.steps += trainer.current_epoch >= 1

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch != trainer.max_epochs - 1:
            return
        if self.profile is not None:
            self.profile.disable()
        now = (time.process_time(), time.thread_time(), cpu_seconds(self.pid),
               time.perf_counter())
        per = [(b - a) * 1e3 / self.steps for a, b in zip(self.start, now, strict=True)]
        self.got = dict(zip(("coordinator_ms", "main_thread_ms", "worker_ms", "wall_ms"),
                            per, strict=True), steps=self.steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5, help="per fit; the first is not timed")
    ap.add_argument("--rounds", type=int, default=1, help="fits, one after the other")
    ap.add_argument("--profile", default=None, help="write cProfile stats of the last fit")
    args = ap.parse_args()
    rounds = []
    for _ in range(args.rounds):
        profile = None
        if args.profile:
            import cProfile

            profile = cProfile.Profile()
        clock = CPU(profile)
        pl.seed_everything(0)
        trainer = pl.Trainer(max_epochs=args.epochs,
                             strategy=SomatizeStrategy(place={"encoder": "worker"}),
                             logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             limit_val_batches=0, callbacks=[clock])
        trainer.fit(bench_dropin.AutoEncoder(), bench_dropin.data())
        print(json.dumps({k: round(v, 3) for k, v in clock.got.items()}), flush=True)
        rounds.append(clock.got)
        if profile is not None:
            profile.dump_stats(args.profile)
    print(f"{os.getcwd()}: medians of {args.rounds} round(s), per step: " + ", ".join(
        f"{k} {statistics.median(r[k] for r in rounds):.3f}" for k in rounds[0]
        if k != "steps") + f"; load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
