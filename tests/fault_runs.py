"""Coordinators whose workers fail in named ways, for tests/test_faults.py.

    python tests/fault_runs.py oom CGROUP      # the worker, put in a small memory cgroup, overeats
    python tests/fault_runs.py killed          # the worker is sent SIGKILL by someone
    python tests/fault_runs.py stopped         # the worker is stopped (SIGSTOP) while it starts
    python tests/fault_runs.py traceback_there # a class of this script fails over there

Each prints the error the coordinator raised.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

import torch
from models import Body, Head

from somatize import Graph, Node, WorkerError
from somatize.remote import configure, runtime_for


def _error(fn) -> None:
    try:
        fn()
    except WorkerError as e:
        print("ERROR", e, flush=True)
        return
    print("NO ERROR", flush=True)


def _overeat(live):
    hog = []
    while True:
        hog.append(bytearray(64 << 20))
        hog[-1][::4096] = b"x" * len(hog[-1][::4096])  # touched: really held


def oom(cgroup: str) -> None:
    g = Graph.somatize(Body().at("gpu") >> Head())
    g.forward(torch.randn(5, 8))
    pid = runtime_for(g).peers["gpu"].pid
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid))
    _error(lambda: runtime_for(g).call("gpu", _overeat))


def killed() -> None:
    g = Graph.somatize(Body().at("gpu") >> Head())
    g.forward(torch.randn(5, 8))
    os.kill(runtime_for(g).peers["gpu"].pid, signal.SIGKILL)
    time.sleep(0.5)
    _error(lambda: g.forward(torch.randn(5, 8)))


def _stop_children(done: threading.Event) -> None:
    me = str(os.getpid())
    while not done.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        os.kill(int(pid), signal.SIGSTOP)
                        return
            except (OSError, IndexError):
                continue
        time.sleep(0.01)


def stopped() -> None:
    faulthandler.dump_traceback_later(150)  # a hang shows where it is, before the test's 180 s
    configure(timeout=10)
    done = threading.Event()
    threading.Thread(target=_stop_children, args=(done,), daemon=True).start()
    g = Graph.somatize(Body().at("gpu") >> Head())
    _error(lambda: g.forward(torch.randn(5, 8)))
    done.set()




class Faulty(Node):
    """Defined in this script's ``__main__``: it travels by value and fails over there."""

    def forward(self, x, ctx):
        return x / undefined_name  # noqa: F821  (the line the traceback must show)


def traceback_there() -> None:
    g = Graph.somatize(Faulty().at("gpu") >> Head())
    try:
        g.forward(torch.randn(5, 8))
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
        print("CAUSE", e.__cause__, flush=True)


def placed_lost() -> None:
    """A placed module's worker killed in the middle of a Lightning fit."""
    import lightning.pytorch as pl
    from dropin_models import AutoEncoder, digits, fit

    from somatize.lightning import SomatizeStrategy

    class Kill(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):
            if i == 1:
                _kill_children()

    model = AutoEncoder()
    _error(lambda: fit(model, SomatizeStrategy(place={"encoder": "worker"}), digits(),
                       max_steps=4, limit_val_batches=0,
                       callbacks=[Kill()]))


def _kill_children() -> None:
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, IndexError):
            continue
    time.sleep(0.5)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
