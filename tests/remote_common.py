"""What the coordinators of tests/remote_*_runs.py share: saying what they saw (one JSON
object a line), the input, and the errors they expect. Nothing here is sent to a worker.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch

from somatize import SomatizeError, WorkerError


def say(**what) -> None:
    print(json.dumps(what), flush=True)


def x() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(5, 8)


def error_of(fn) -> dict:
    """What ``fn()`` raised: its class and message (or that it raised nothing)."""
    try:
        fn()
    except Exception as e:
        return {"error": type(e).__name__, "somatize": isinstance(e, SomatizeError),
                "message": str(e)}
    return {"error": None}


def _kill_when_written(path: str) -> None:
    def kill():
        for _ in range(3000):
            if os.path.exists(path):
                os.kill(int(open(path).read()), signal.SIGKILL)
                return
            time.sleep(0.01)

    threading.Thread(target=kill, daemon=True).start()


def worker_error(g, xs, **kw) -> tuple[str, float]:
    """``g.forward`` must raise WorkerError: its message, and the seconds it took."""
    t = time.monotonic()
    try:
        g.forward(xs, **kw)
    except WorkerError as e:
        return str(e), time.monotonic() - t
    raise SystemExit("no error")
