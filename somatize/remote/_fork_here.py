"""A fork server forked from this process at the fit's start, where that is safe: it
holds torch, its RPC and the compiler's modules imported already, so the first embedded
worker starts in a fraction of a second instead of after a fresh interpreter's imports
(2-5 s here). Each worker it forks starts as one forked from ``_fork_server.py`` does,
with somatize imported afresh (by the server, as a worker's environment has it: never
this process's modules of somatize), and torch's random state and global settings as a
fresh interpreter has them.

    server = fork_here()          # None, and why logged, where it is not safe
    proc = server.popen(["-m", "somatize.remote", ...], env, cwd, stdin=subprocess.PIPE)

Not safe, so a fresh fork server instead (``fork_workers``): CUDA initialized here, any
thread beside the calling one (forking copies one thread: a lock another holds would
never be released), ``SOMATIZE_FORK_HERE=0``. libgomp keeps its team of math threads per
calling thread, and a fork's copy of that team has no threads: its first parallel op
would wait forever, so the team is released (``omp_pause_resource_all``) before the fork.
Only this process may ask it for a worker (its workers would carry this process's
modules, which are no other's).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from . import _fork_server
from ._forks import _PREFIX, ForkServer, sweep

log = logging.getLogger(__name__)

HERE_ENV = "SOMATIZE_FORK_HERE"  # "0": embedded workers never fork from the coordinator
_here: list[ForkServer] = []  # this process's, once forked


def current() -> ForkServer | None:
    """The server forked from this process, if it is there."""
    return _here[0] if _here and _here[0].alive else None


def fork_here(preload=()) -> ForkServer | None:
    """Fork a server from this process, for this process's embedded workers; None (and
    why, logged) where it is not safe."""
    why = why_not()
    if why is None:
        _release_math_threads()
        why = _other_threads()
    if why is not None:
        log.info("embedded workers fork from a fresh interpreter, not from this process: %s",
                 why)
        return None
    from ._private import OPTIMIZER_IMPORTS
    from ._settings import serving_env

    sweep()
    where = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")  # 0700: this user's alone
    path = os.path.join(where, "socket")
    # a worker's environment as spawn gives it (SERVING_ENV added): what this process read
    # at start is what its workers run with (libgomp's wait policy, huge pages)
    serving = serving_env(dict(os.environ))
    control_r, control_w = os.pipe()  # its stdin: closed when this process ends
    ready_r, ready_w = os.pipe()
    for f in (sys.stdout, sys.stderr):  # what is buffered is written once, here
        with contextlib.suppress(Exception):
            f.flush()
    pid = os.fork()
    if pid == 0:  # never returns
        _serve_here(control_r, ready_w, path, serving, os.getppid(),
                    [*OPTIMIZER_IMPORTS, *preload])
    os.close(control_r)
    os.close(ready_w)
    server = ForkServer(path, _Child(pid, control_w, ready_r))  # ready() waits for it
    _here[:] = [server]
    import atexit

    atexit.register(server.close)
    return server


def why_not() -> str | None:
    """Why this process cannot fork a worker server now, or None."""
    if os.environ.get(HERE_ENV, "1") == "0":
        return f"{HERE_ENV}=0"
    if "torch" not in sys.modules:
        return "torch is not imported here"
    import threading

    import torch

    if torch.cuda.is_initialized():
        return "CUDA is initialized here (a fork cannot use it)"
    if threading.current_thread() is not threading.main_thread():
        return "the fit runs on a thread other than the main one"
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads run here"
    return None


def _release_math_threads() -> None:
    # this thread's OpenMP team (libgomp's: a fork could not use it) and OpenBLAS's pools
    # (numpy's, scipy's: their own fork handler would release them): made again at need
    for lib in _math_libraries():
        with contextlib.suppress(OSError):
            dll = ctypes.CDLL(lib)
            for release, args in (("omp_pause_resource_all", (2,)),  # omp_pause_hard
                                  ("blas_thread_shutdown_", ())):
                with contextlib.suppress(AttributeError):
                    getattr(dll, release)(*args)


_MATH_LIBRARIES = ("libgomp", "libomp", "libiomp", "openblas")


def _math_libraries() -> list[str]:
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f
                 if any(k in line.rpartition("/")[2] for k in _MATH_LIBRARIES)}
    return sorted(p for p in paths if p.startswith("/") and ".so" in p)


def _other_threads(wait_s: float = 0.5) -> str | None:
    # a released team's threads exit just after the call returns: give them a moment
    deadline = time.monotonic() + wait_s
    while True:
        tasks = os.listdir("/proc/self/task")
        if len(tasks) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    if len(tasks) == 1:
        return None
    names = []
    for t in tasks:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read().strip())
    return f"{len(tasks)} threads run here ({', '.join(sorted(names))})"


class _Child:
    """The forked server, as ``ForkServer`` asks of its process: ``stdin`` (closed: it
    ends), ``stdout`` (it says "ready"), ``poll``, ``wait``, ``kill``."""

    def __init__(self, pid: int, control_w: int, ready_r: int):
        self.pid, self.returncode = pid, None
        self.args = ["somatize fork server", str(pid)]
        self.stdin = open(control_w, "wb", buffering=0)
        self.stdout = open(ready_r, "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _serve_here(control_r: int, ready_w: int, path: str, serving: dict[str, str], owner: int,
                imports: list[str]) -> None:
    """The forked server: serve until this process ends; in each fork it makes, run the
    worker asked for. Never returns."""
    code = 1
    try:
        _own_descriptors(control_r, ready_w)
        _fresh_process()
        for name in imports:
            __import__(name)
        _import_as_a_worker(serving)
        forked = _fork_server._serve(path, [], mine=_fork_server.read_at_start(serving),
                                     owner=owner)
        if forked is None:
            os._exit(0)
        code = _run_forked(forked)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        os._exit(code)  # never this process's atexit handlers, finalizers or buffers


def _own_descriptors(control_r: int, ready_w: int) -> None:
    # stdin: this process holds its other end; stdout: "ready"; stderr: this process's.
    # Every other descriptor inherited is pointed at /dev/null, its number kept: a pipe
    # of this process's is not held open by its workers, and an object of this process's
    # that closes its number one day closes nothing of theirs
    os.dup2(control_r, 0)
    os.dup2(ready_w, 1)
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != null:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
    os.close(null)
    import io

    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")


_dropped: list = []  # somatize's modules and loggers as this process had them: kept alive


def _fresh_process() -> None:
    """What a worker's start would see in a fresh interpreter, of what this process
    changed: signal handlers, torch's random state and settings, logging, somatize."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    import random

    import torch

    torch.seed()  # a fresh interpreter's is random too
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision("highest")
    torch.set_flush_denormal(False)
    torch.autograd.set_detect_anomaly(False)
    torch.set_grad_enabled(True)
    loggers = logging.Logger.manager.loggerDict
    root = logging.getLogger()
    _dropped.extend(root.handlers)
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    for name in [n for n in loggers if n == "somatize" or n.startswith("somatize.")]:
        _dropped.append(loggers.pop(name))
    for name in [n for n in sys.modules if n == "somatize" or n.startswith("somatize.")]:
        _dropped.append(sys.modules.pop(name))  # each worker imports its own


# what a worker imports of somatize before it serves (remote/_serve.py's main), imported
# once here, afresh, as a worker's environment has it: somatize reads at import only
# whether it serves (SOMATIZE_SERVING, _log) and SOMATIZE_ISOLATE, which a worker's
# environment has as spawn gives it (serving_env); the rest it reads when it runs
WORKER_MODULES = ("somatize.remote._serve", "somatize.remote._admit", "somatize.remote._sealed",
                  "somatize.remote._secret", "somatize.remote._membership",
                  "somatize.remote._exposure", "somatize.remote._settings",
                  "somatize.remote._wire", "somatize.torch", "somatize.store",
                  "somatize._engine", "cloudpickle")


def _import_as_a_worker(serving: dict[str, str]) -> None:
    import threading

    was = dict(os.environ)
    os.environ.clear()
    os.environ.update(serving)
    try:
        for name in WORKER_MODULES:
            __import__(name)
    finally:
        os.environ.clear()
        os.environ.update(was)
    if threading.active_count() != 1:  # _serve refuses to fork then: said here first
        print(f"somatize's modules started threads: {threading.enumerate()}", file=sys.stderr)


def _run_forked(forked) -> int:
    """Be the worker ``forked`` asks for (``_fork_server._become``); its exit code."""
    import runpy

    how, what = _fork_server._become(*forked)
    try:
        if how == "module":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(what, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    for h in logging.getLogger().handlers:  # the worker's own (its stderr)
        with contextlib.suppress(Exception):
            h.flush()
    return code
