"""Coordinators for tests/test_fork_here.py: a placed fit whose worker is forked from a
server forked from this process (no server named), what that worker sees of itself, and
the same fit where this process cannot fork safely.

    python fork_here_runs.py fit OUT.json [thread]
    python fork_here_runs.py killed PID_FILE
"""

import json
import logging
import os
import signal
import sys
import threading
import time

import lightning.pytorch as pl
import oracle
import torch
from dropin_models import AutoEncoder, digits
from scenario import play

import somatize
from somatize.lightning import SomatizeStrategy
from somatize.remote import _fork_here


def _seen(live) -> dict:
    import logging
    import signal

    import torch

    import somatize

    return {"ppid": os.getppid(), "pid": os.getpid(),
            "marked": hasattr(somatize, "_marked_by_the_coordinator"),
            "precision": torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "anomaly": torch.is_anomaly_enabled(),
            "sigusr1": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
            "root_handlers": len(logging.getLogger().handlers),
            "seed": torch.initial_seed()}


class _Seen(pl.Callback):
    """What the worker saw of itself, asked at the first epoch's end."""

    seen = None

    def on_train_epoch_end(self, trainer, pl_module):
        if self.seen is None:
            self.seen = trainer.strategy.part("encoder").call("worker", _seen)


def _settings_of_a_user() -> None:
    # what a script may set before its fit: none of it is a fresh worker's
    somatize._marked_by_the_coordinator = True
    torch.set_float32_matmul_precision("medium")
    torch.autograd.set_detect_anomaly(True)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    logging.getLogger().addHandler(logging.StreamHandler(sys.stdout))


def fit(out: str, *how: str) -> None:
    """Plain Lightning, then the encoder placed: losses and weights, and what the worker
    saw; ``thread``: a thread of this process runs through the placed fit's start."""
    pl.seed_everything(0)
    plain_model = AutoEncoder()
    _, plain = oracle.fit(plain_model, "auto", digits(), max_epochs=2)
    _settings_of_a_user()
    stop = threading.Event()
    if "thread" in how:
        threading.Thread(target=stop.wait, daemon=True).start()
    pl.seed_everything(0)
    model = AutoEncoder()
    strategy = SomatizeStrategy(place={"encoder": "worker"})
    seen = _Seen()
    _, placed = oracle.fit(model, strategy, digits(), max_epochs=2, callbacks=[seen])
    stop.set()
    here = _fork_here.current()
    oracle.exact(oracle.weights(plain_model), oracle.weights(model))
    with open(out, "w") as f:
        json.dump({"plain": plain, "placed": placed, "seen": seen.seen, "me": os.getpid(),
                   "seed": torch.initial_seed(), "server": here.proc.pid if here else None,
                   "where": {k: list(v) for k, v in strategy.where().items()}}, f)
    strategy.close()
    print("closed", flush=True)


def killed(pid_file: str) -> None:
    """A placed fit that never ends; the pids of this process, its worker and the server
    written to ``pid_file`` once it trains (the test kills this process)."""

    class Hold(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                pids = {"me": os.getpid(), "server": _fork_here.current().proc.pid,
                        "worker": list(trainer.strategy.where()["encoder"])[0]}
                with open(pid_file + ".tmp", "w") as f:
                    json.dump(pids, f)
                os.replace(pid_file + ".tmp", pid_file)
                time.sleep(600)

    pl.seed_everything(0)
    strategy = SomatizeStrategy(place={"encoder": "worker"})
    oracle.fit(AutoEncoder(), strategy, digits(), max_epochs=1, callbacks=[Hold()])


if __name__ == "__main__":
    play(globals(), sys.argv)
