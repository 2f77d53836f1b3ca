"""Coordinators for tests/test_forks.py: a graph's node on an embedded worker, and what
that worker sees of itself (forked from conftest's server or started afresh, the same).

    python fork_runs.py worker OUT.json
"""

import json
import os
import sys

import torch
from scenario import play

from somatize import Graph
from somatize.remote import runtime_for
from somatize.torch import node


def _seen(live) -> dict:
    import torch

    return {"argv": sys.argv[1:], "cwd": os.getcwd(), "path": sys.path[:4],
            "main": sys.modules["__main__"].__file__, "ppid": os.getppid(),
            "pid": os.getpid(), "threads": torch.get_num_threads(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("SOMATIZE_RUN",
                                                                         "OMP_", "TP_"))},
            "stdin": os.readlink("/proc/self/fd/0").startswith("pipe:")}


def worker(out: str) -> None:
    torch.manual_seed(0)
    g = Graph.somatize(node(torch.nn.Linear(4, 3)).at("gpu"))
    y = g.forward(torch.arange(8.0).reshape(2, 4))
    seen = runtime_for(g).call("gpu", _seen)
    with open(out, "w") as f:
        json.dump({"y": y.tolist(), "seen": seen, "me": os.getpid()}, f)
    g.close()
    print("closed", flush=True)


def server_gone(out: str) -> None:
    """This process's own fork server killed before the run: the worker starts afresh."""
    import signal

    from somatize.remote import fork_workers

    server = fork_workers()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    worker(out)


if __name__ == "__main__":
    play(globals(), sys.argv)
