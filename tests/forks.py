"""A warm start for scenario processes (tests/scenario.py): one process per test process
imports torch and Lightning once (about 8 s of a core each time, most of it Lightning's
own imports), then forks a process for each scenario, as Python's ``forkserver`` does with
its ``preload``. What runs in the fork is the scenario script itself, as ``python SCRIPT
ARGS`` would run it: its own pid, environment, working directory, ``sys.argv``,
``sys.path`` and standard streams; its own RPC, workers and exit. Only the modules above
are already imported, and somatize never is (it reads its environment when imported).

    forked = Forks.get()                   # None where no warm process can serve
    done = forked.run([script, *args], cwd, environ, timeout)   # a CompletedProcess

A scenario whose environment changes what those imports read (``OMP_*``, ``TORCH_*``,
``PYTHON*``, ...) runs in a fresh interpreter instead (``forkable``).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

PRELOAD = ["numpy", "torch", "torch.distributed.rpc", "lightning.pytorch", "safetensors.torch",
           "cloudpickle", "sklearn.datasets"]
# read when those modules are imported, or when the interpreter starts: a scenario that sets
# any of them otherwise than the warm process was started with needs an interpreter of its own
READ_AT_START = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA",
                 "LD_", "MALLOC_", "THP_", "PYTHON", "PL_", "LIGHTNING", "NUMPY", "SKLEARN",
                 "SCIPY")


def _read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k != "PYTHONPATH"}


def forkable(argv: list[str], environ: dict[str, str], warm_env: dict[str, str]) -> bool:
    """Whether ``argv`` (a script and its arguments) can run forked from a warm process
    started with ``warm_env``."""
    return (bool(argv) and not argv[0].startswith("-") and argv[0].endswith(".py")
            and _read_at_start(environ) == _read_at_start(warm_env))


class Forks:
    """This test process's warm process, started at the first ``get()``."""

    _one: Forks | None = None
    _failed = False

    @classmethod
    def get(cls, environ: dict[str, str]) -> Forks | None:
        """The warm process, started now if there is none or it has ended; None when one
        could not be started (each scenario then starts an interpreter of its own)."""
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
        self.dir = tempfile.mkdtemp(prefix="somatize-forks-")
        self.path = os.path.join(self.dir, "socket")
        self.env = dict(environ)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, cwd=self.dir)
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"the warm process said {line!r}")
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # it ends when its stdin does
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.dir)

    def start(self, argv: list[str], cwd: str, environ: dict[str, str],
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text: bool = True) -> Forked:
        """``python *argv`` forked, running: a ``Forked``, which answers as a Popen does."""
        ends, mine = [os.open(os.devnull, os.O_RDONLY)], []
        for how in (stdout, stderr):
            if how == subprocess.PIPE:
                r, w = os.pipe()
                ends.append(w)
                mine.append(r)
            elif how == subprocess.DEVNULL or how is None:
                ends.append(os.open(os.devnull, os.O_WRONLY))
                mine.append(None)
            else:
                raise ValueError(f"tests/forks.py: stdout/stderr {how!r}: PIPE or DEVNULL")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": argv, "cwd": str(cwd), "env": environ}).encode()
            socket.send_fds(conn, [request], ends)
            conn.settimeout(60)
            pid = int(conn.recv(64))
        finally:
            for fd in ends:
                os.close(fd)
        return Forked([sys.executable, *argv], pid, conn, mine, text)

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


class Forked:
    """A forked scenario, answering as ``subprocess.Popen`` does: ``pid``, ``stdout`` and
    ``stderr`` (pipes, or None), ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``kill``, ``returncode``."""

    def __init__(self, args, pid: int, conn: socket.socket, fds, text: bool):
        self.args, self.pid, self._conn, self.returncode = args, pid, conn, None
        self._read: dict[int, list[bytes]] = {}  # what communicate read, by pipe
        self.stdout, self.stderr = (None if fd is None else
                                    open(fd, "r" if text else "rb", closefd=True)
                                    for fd in fds)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                said = self._conn.recv(64)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.returncode = int(said) if said else -signal.SIGKILL  # the warm one died
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0.0001)
        except subprocess.TimeoutExpired:
            return None

    def communicate(self, timeout: float | None = None):
        """Read stdout and stderr to their ends, then wait for the exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while open_ := [f for f in (self.stdout, self.stderr) if f is not None and not f.closed]:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            ready, _, _ = select.select(open_, [], [], left)
            for f in ready:
                chunk = os.read(f.fileno(), 1 << 16)
                self._read.setdefault(id(f), []).append(chunk)
                if not chunk:
                    f.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple(None if f is None else self._text(f) for f in (self.stdout, self.stderr))

    def _text(self, f):
        got = b"".join(self._read.get(id(f), []))
        return got if "b" in f.mode else got.decode(errors="replace").replace("\r\n", "\n")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# -- the warm process ---------------------------------------------------------------------
def _serve(path: str):
    """Answer requests until stdin closes; returns only in a fork, with its request."""
    for name in PRELOAD:
        __import__(name)
    import gc
    import threading

    # forking copies one thread: no Python thread may run beside this one. (numpy's and
    # scipy's OpenBLAS keep idle threads of their own, which they stop at a fork and start
    # again after it, by pthread_atfork.)
    if threading.active_count() != 1:
        print(f"threads {threading.enumerate()}", flush=True)
        sys.exit(1)
    gc.freeze()  # what is imported stays shared with the forks, not copied by their gc
    base = [p for p in sys.path[1:]
            if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(64)
    waiting: dict[int, socket.socket] = {}  # a fork's pid: who waits for its exit code
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([srv, sys.stdin], [], [], 0.05)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                conn.close()
        if sys.stdin in ready and not os.read(0, 1):
            return None
        if srv in ready:
            conn, _ = srv.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                srv.close()
                conn.close()
                for c in waiting.values():
                    c.close()
                return request, fds, base
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            waiting[pid] = conn


def _become(request: dict, fds: list[int], base: list[str]) -> str:
    """Turn this fork into ``python ARGV`` as ``request`` says; answers the script."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script, *args = request["argv"]
    script = os.path.abspath(script)
    sys.argv = [script, *args]
    paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *map(os.path.abspath, paths), *base]
    return script


if __name__ == "__main__":
    forked = _serve(sys.argv[1])
    if forked is None:
        sys.exit(0)
    import runpy

    runpy.run_path(_become(*forked), run_name="__main__")
