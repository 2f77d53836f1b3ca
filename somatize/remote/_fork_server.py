"""The fork server's program (``somatize.remote._forks`` starts it, by path, and talks to
it): it imports what it is told to preload, then forks a process for each request on its
socket, for its own user and namespaces only, when the request's environment reads at
start as its own did. The fork runs ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``
as a fresh interpreter would. It imports nothing but the standard library, and never
somatize (which reads its environment when imported: each fork imports it afresh).

    python -c "...run_path" .../_fork_server.py SOCKET torch torch.distributed.rpc
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys

# read when torch (or the interpreter) starts: a process whose environment says otherwise
# of any of them than the server's did needs an interpreter of its own
# (a value read later, such as Lightning's PL_GLOBAL_SEED, is simply set in the fork)
READ_AT_START = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA",
                 "NCCL_", "LD_", "MALLOC_", "THP_", "PYTHON")
_NOT_READ = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
             # set by libraries as they run (scikit-learn and joblib when imported, for
             # Intel's OpenMP, which torch's wheels do not use; Lightning; inductor), and
             # read later if at all: a coordinator that imported them has them, the server not
             "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "PYTORCH_NVML_BASED_CUDA_CHECK",
             "TORCHINDUCTOR_CACHE_DIR")


def read_at_start(env: dict[str, str]) -> dict[str, str]:
    """The entries of ``env`` read once, when the interpreter and torch start."""
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k not in _NOT_READ}


def _serve(path: str, preload: list[str], mine: dict | None = None, owner: int | None = None):
    """Answer requests until stdin closes; returns only in a fork, with its request.
    ``mine``: what starting read (default: this environment); ``owner``: the one process
    it forks for (default: any of this user's, in its namespaces)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for its owner
    if mine is None:
        mine = read_at_start(dict(os.environ))  # as started (an import may set more)
    for name in preload:
        __import__(name)
    import gc
    import threading

    # forking copies one thread: no Python thread may run beside this one
    if threading.active_count() != 1:
        print(f"threads {threading.enumerate()}", flush=True)
        sys.exit(1)
    gc.freeze()  # what is imported stays shared with the forks, not copied by their gc
    given = _paths(os.environ.get("PYTHONPATH", ""))
    base = [p for p in sys.path[1:] if p not in given]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(64)
    waiting: dict[int, socket.socket] = {}  # a fork's pid: who waits for its exit code
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([srv, sys.stdin], [], [], 0.05)
        _reap(waiting)
        if sys.stdin in ready and not os.read(0, 1):  # its owner closed it, or died
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))
            return None
        if srv not in ready:
            continue
        conn, _ = srv.accept()
        try:
            conn.settimeout(10)  # a client that connects and says nothing holds up no one
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            conn.settimeout(None)
            request = json.loads(msg)
        except (OSError, ValueError):
            conn.close()
            continue
        why = _refusal(conn, request, fds, mine, owner)
        if why is not None:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(why.encode())
            conn.close()
            continue
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            for c in waiting.values():
                c.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            return request, fds, base
        for fd in fds:
            os.close(fd)
        conn.send(str(pid).encode())
        waiting[pid] = conn


def _refusal(conn: socket.socket, request: dict, fds: list, mine: dict,
             owner: int | None = None) -> str | None:
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    if uid != os.getuid():
        return f"refused: uid {uid} is not this server's user"
    if owner is not None and pid != owner:  # forked from its owner: it holds its modules
        return f"refused: it forks for process {owner} only, not {pid}"
    if _namespaces(pid) != _namespaces(os.getpid()):  # a fork lives where its server does
        return "refused: it runs in other namespaces (network, mounts, pids) than this server"
    if len(fds) != 3 or not isinstance(request.get("argv"), list) or not request["argv"]:
        return "refused: a request is argv, cwd, env and three streams"
    argv = request["argv"]
    if argv[0].startswith("-") and (argv[0] != "-m" or len(argv) < 2):
        return f"refused: {argv[0]!r}: it forks `-m MODULE ARGS` or `SCRIPT ARGS` only"
    theirs = read_at_start(request["env"])
    if theirs != mine:
        differ = sorted(k for k in {*theirs, *mine} if theirs.get(k) != mine.get(k))
        return f"refused: its environment sets what starting reads otherwise ({differ})"
    return None


def _namespaces(pid: int) -> tuple:
    try:
        return tuple(os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("net", "mnt", "pid"))
    except OSError:
        return ("unknown", pid)


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            conn.close()


def _paths(pythonpath: str) -> list[str]:
    # as the interpreter reads PYTHONPATH: an empty entry is the working directory
    return [os.path.abspath(p or os.getcwd()) for p in pythonpath.split(os.pathsep)] \
        if pythonpath else []


def _become(request: dict, fds: list[int], base: list[str]) -> tuple[str, str]:
    """Turn this fork into ``python ARGV`` as ``request`` says: ("module", name) or
    ("script", path), what to run."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False),
                                  write_through=bool(env.get("PYTHONUNBUFFERED")))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    paths = _paths(env.get("PYTHONPATH", ""))
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
        sys.path[:] = [os.getcwd(), *paths, *base]
        return "module", argv[1]
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[:] = [os.path.dirname(script), *paths, *base]
    return "script", script


if __name__ == "__main__":
    forked = _serve(sys.argv[1], sys.argv[2:])
    if forked is None:
        sys.exit(0)
    import runpy

    how, what = _become(*forked)
    if how == "module":
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(what, run_name="__main__")

