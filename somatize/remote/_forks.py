"""Processes forked from a warm one: a server imports torch (and what ``preload`` names)
once, then forks each process asked of it, which runs ``python -m MODULE ARGS`` or
``python SCRIPT ARGS`` as a fresh interpreter would: its own pid, environment, working
directory, ``sys.argv``, ``sys.path`` and standard streams. An embedded worker started
fresh spends about 4 s of a core importing torch (and the compiler's modules, which
building an optimizer imports); forked, it spends a fraction of a second.

    server = ForkServer.start(["torch", "torch.distributed.rpc"])
    proc = server.popen(["-m", "somatize.remote", "--name", "gpu", ...], env, cwd,
                        stdin=subprocess.PIPE)      # answers as subprocess.Popen does
    server.close()

``fork_workers()`` starts one for the embedded workers of this process and of the
processes it starts (``SOMATIZE_FORKS`` names its socket). The server's program is
``_fork_server.py``, which imports nothing but the standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

from . import _fork_server
from ._death import process_state
from ._fork_server import read_at_start

log = logging.getLogger(__name__)

FORKS_ENV = "SOMATIZE_FORKS"  # the server's socket embedded workers are forked from, or off
WORKER_PRELOAD = ("torch", "torch.distributed.rpc")  # and remote/_private's OPTIMIZER_IMPORTS
__all__ = ["FORKS_ENV", "WORKER_PRELOAD", "ForkServer", "Forked", "fork_workers", "named",
           "read_at_start"]


class ForkServer:
    """A warm process that forks the processes asked of it (``popen``); it ends with the
    process that started it, or at ``close()``."""

    def __init__(self, path: str, proc: subprocess.Popen | None = None):
        self.path, self.proc = path, proc
        self._pending = proc is not None  # started here: "ready" not read yet
        self._timeout = 180.0

    @classmethod
    def start(cls, preload=WORKER_PRELOAD, env: dict[str, str] | None = None,
              timeout: float = 180.0, wait: bool = True) -> ForkServer:
        """Start a server that imports ``preload`` first, in ``env`` (default: this
        process's environment), listening on a socket only this user can reach.
        ``wait=False``: return at once; the first ``popen`` waits for it to be ready."""
        sweep()  # what servers killed before they could clean up left behind
        where = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")  # 0700: this user's alone
        path = os.path.join(where, "socket")
        # run by path, not as a module of somatize: the server never imports somatize
        program = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], " \
            "run_name='__main__')"
        proc = subprocess.Popen(
            [sys.executable, "-c", program, _fork_server.__file__, path, *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(os.environ if env is None else env), cwd=where)
        server = cls(path, proc)
        server._timeout = timeout
        atexit.register(server.close)
        if wait:
            server.ready()
        return server

    def ready(self) -> None:
        """Wait for a server started with ``wait=False`` to be ready (RuntimeError if it
        does not start)."""
        if self._pending is not True:
            return
        self._pending = False
        proc = self.proc
        ready, _, _ = select.select([proc.stdout], [], [], self._timeout)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            proc.kill()
            proc.wait(timeout=10)
            self.close()
            raise RuntimeError(f"the fork server did not start (it said {line!r}, exit code "
                               f"{proc.poll()})")

    @property
    def alive(self) -> bool:
        """Whether the server answers (its socket is there, its process lives), once it
        is ready."""
        if self._pending is True:
            try:
                self.ready()
            except RuntimeError as e:
                log.warning("%s: embedded workers start afresh", e)
                return False
        return os.path.exists(self.path) and (self.proc is None or self.proc.poll() is None)

    def close(self) -> None:
        """End the server (the processes it forked live on); idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # it ends when its stdin does
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))

    def popen(self, argv: list[str], env: dict[str, str], cwd: str, stdin=None, stdout=None,
              stderr=None, text: bool = False) -> Forked | None:
        """``python *argv`` forked, running, as a ``Forked``; None when the server cannot
        fork it (it is gone, or ``env`` differs from its own in what starting reads).
        ``stdin``: PIPE (``.stdin`` writes to it) or None; ``stdout``, ``stderr``: None
        (this process's), PIPE or DEVNULL."""
        ends, mine = [], []
        for i, how in enumerate((stdin, stdout, stderr)):
            if how == subprocess.PIPE:
                r, w = os.pipe()
                ends.append(r if i == 0 else w)
                mine.append(w if i == 0 else r)
            elif how == subprocess.DEVNULL:
                ends.append(os.open(os.devnull, os.O_RDONLY if i == 0 else os.O_WRONLY))
                mine.append(None)
            elif how is None:
                ends.append(os.dup(i))
                mine.append(None)
            else:
                raise ValueError(f"fork server: a stream as {how!r}: give PIPE, DEVNULL or None")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(60)
            conn.connect(self.path)
            request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode()
            socket.send_fds(conn, [request], ends)
            said = conn.recv(4096).decode()
        except OSError as e:
            log.info("the fork server at %s did not answer (%s): a fresh process instead",
                     self.path, e)
            said = ""
        finally:
            for fd in ends:
                os.close(fd)
        if not said.isdigit():
            conn.close()
            for fd in mine:
                if fd is not None:
                    os.close(fd)
            if said:
                log.info("the fork server did not fork %s: %s", argv[:3], said)
            return None
        return Forked([sys.executable, *argv], int(said), conn, mine, text)


class Forked:
    """A forked process, answering as ``subprocess.Popen`` does: ``pid``, ``args``,
    ``stdin``, ``stdout``, ``stderr`` (pipes, or None), ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``terminate``, ``returncode``. Its exit
    code comes from the server, which is its parent."""

    def __init__(self, args, pid: int, conn: socket.socket, fds: list, text: bool):
        self.args, self.pid, self._conn, self.returncode = args, pid, conn, None
        self._read: dict[int, list[bytes]] = {}  # what communicate read, by pipe
        w, r1, r2 = fds
        self.stdin = None if w is None else open(w, "wb", buffering=0)
        self.stdout, self.stderr = (None if fd is None else open(fd, "r" if text else "rb")
                                    for fd in (r1, r2))

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                said = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if said:
                self.returncode = int(said)
            else:  # the server ended first: the process is init's now, its code unknown
                self._await_gone(timeout)
                self.returncode = -signal.SIGKILL
                log.warning("process %d ended after the fork server that started it: its "
                            "exit code is unknown (said as SIGKILL)", self.pid)
            self._conn.close()
        return self.returncode

    def _await_gone(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while process_state(self.pid) not in ("?", "Z"):
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)

    def poll(self) -> int | None:
        # asked before every message: nothing to read is no exception raised and caught
        if self.returncode is None and not select.select([self._conn], [], [], 0)[0]:
            return None
        try:
            return self.wait(timeout=0.0)
        except subprocess.TimeoutExpired:  # the server ended first, the process lives on
            return None

    def communicate(self, timeout: float | None = None):
        """Read stdout and stderr to their ends, then wait for the exit code."""
        if self.stdin is not None:
            self.stdin.close()
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


_named: dict[str, ForkServer] = {}


def named(env: dict[str, str]) -> ForkServer | None:
    """The server ``env`` names (``SOMATIZE_FORKS``), if it is there (``off``: none, and
    ``SomatizeStrategy`` starts none)."""
    path = env.get(FORKS_ENV)
    if not path or path == "off":
        return None
    server = _named.setdefault(path, ForkServer(path))
    return server if server.alive else None


_PREFIX = "somatize-forks-"  # + the owner's pid: a directory of a dead owner is swept


def sweep() -> list[str]:
    """Remove the socket directories of this user's fork servers whose owner is gone (a
    SIGKILL leaves no time to clean up); returns what was removed."""
    gone, top = [], tempfile.gettempdir()
    try:
        names = os.listdir(top)
    except OSError:
        return gone
    for name in names:
        owner = name[len(_PREFIX):].partition("-")[0]
        if not name.startswith(_PREFIX) or not owner.isdigit():
            continue
        where = os.path.join(top, name)
        try:
            st = os.lstat(where)
        except OSError:
            continue
        if st.st_uid != os.geteuid() or not _gone(int(owner)):
            continue
        with contextlib.suppress(OSError):
            for f in os.listdir(where):
                os.unlink(os.path.join(where, f))
            os.rmdir(where)
            gone.append(where)
    return gone


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return True  # another user's process now: the directory's owner (this user) is gone
    return False


def fork_workers(preload=(), wait: bool = True) -> ForkServer:
    """Fork the embedded workers that this process, and the processes it starts, start
    from now on, from one warm server that imported torch, its RPC and what building an
    optimizer imports once (and ``preload``, more modules: your model's package): each
    starts in a fraction of a second of a core instead of about 4 s. For many short runs
    in one session (a test suite, a sweep). A worker whose environment sets what torch
    reads at start otherwise than this process did (``OMP_*``, ``TORCH_*``...) starts
    fresh. ``wait=False``: return at once, the server importing meanwhile (the first
    worker waits for it)."""
    from ._private import OPTIMIZER_IMPORTS
    from ._settings import serving_env

    server = ForkServer.start([*WORKER_PRELOAD, *OPTIMIZER_IMPORTS, *preload],
                              env=serving_env(dict(os.environ)), wait=wait)
    os.environ[FORKS_ENV] = server.path
    _named[server.path] = server
    return server
