"""A warm start for scenario processes (tests/scenario.py): one process per test process
imports torch and Lightning once (about 8 s of a core each time, most of it Lightning's
own imports), then forks a process for each scenario, as Python's ``forkserver`` does with
its ``preload``. What runs in the fork is the scenario script itself, as ``python SCRIPT
ARGS`` would run it: its own pid, environment, working directory, ``sys.argv``,
``sys.path`` and standard streams; its own RPC, workers and exit (tests/forked_main.py
runs it, and ends the process without Python's slow finalization). Only the modules above
are already imported, and somatize never is (it reads its environment when imported).
The server is the library's (somatize/remote/_forks.py), which also forks embedded
workers (``fork_workers``, started for each test process in conftest.py).

    forked = Forks.get(environ)            # None where no warm process can serve
    done = forked.run([script, *args], cwd, environ, timeout)   # a CompletedProcess

A scenario whose environment changes what those imports read (``OMP_*``, ``TORCH_*``,
``PYTHON*``, ...) runs in a fresh interpreter instead (``forkable``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from somatize.remote._forks import Forked, ForkServer, read_at_start

MAIN = str(Path(__file__).resolve().parent / "forked_main.py")  # runs it, then ends at once
PRELOAD = ["numpy", "torch", "torch.distributed.rpc", "lightning.pytorch", "safetensors.torch",
           "cloudpickle", "sklearn.datasets"]
__all__ = ["PRELOAD", "Forked", "Forks", "forkable"]


def forkable(argv: list[str], environ: dict[str, str], warm_env: dict[str, str]) -> bool:
    """Whether ``argv`` (a script and its arguments) can run forked from a warm process
    started with ``warm_env``."""
    return (bool(argv) and not argv[0].startswith("-") and argv[0].endswith(".py")
            and read_at_start(environ) == read_at_start(warm_env))


class Forks:
    """This test process's warm process, started at the first ``get()``."""

    _one: Forks | None = None
    _failed = False

    @classmethod
    def get(cls, environ: dict[str, str]) -> Forks | None:
        """The warm process, started now if there is none or it has ended; None when one
        could not be started (each scenario then starts an interpreter of its own)."""
        if cls._one is not None and read_at_start(cls._one.env) != read_at_start(environ):
            cls._one.close()  # this process's environment changed what starting reads
            cls._one = None
        if cls._one is not None and cls._one.proc.poll() is not None:
            print(f"tests/forks.py: the warm process ended (exit code "
                  f"{cls._one.proc.returncode}); starting another", file=sys.stderr)
            cls._one.close()
            cls._one = None
        if cls._one is None and not cls._failed:
            try:
                cls._one = cls(environ)
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                cls._failed = True
                print(f"tests/forks.py: no warm process ({e}); each scenario starts its own "
                      "interpreter", file=sys.stderr)
        return cls._one

    def __init__(self, environ: dict[str, str]):
        self.env = dict(environ)
        self.server = ForkServer.start(PRELOAD, env=self.env)
        self.proc = self.server.proc

    def close(self) -> None:
        self.server.close()

    def start(self, argv: list[str], cwd: str, environ: dict[str, str],
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text: bool = True) -> Forked:
        """``python *argv`` forked, running: a ``Forked``, which answers as a Popen does."""
        forked = self.server.popen([MAIN, *argv], environ, str(cwd), stdin=subprocess.DEVNULL,
                                   stdout=stdout, stderr=stderr, text=text)
        if forked is None:
            raise RuntimeError(f"tests/forks.py: the warm process would not fork {argv}")
        forked.args = [sys.executable, *argv]
        return forked

    def run(self, argv: list[str], cwd: str, environ: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        """``python *argv`` forked, to its end (killed at ``timeout``, as subprocess.run)."""
        proc = self.start(argv, cwd, environ)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
