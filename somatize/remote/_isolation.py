"""A run's own network: the listeners of the coordinator and its embedded workers live in
a network namespace that only the run's processes enter, so no other user of the machine
reaches them (TensorPipe's listeners answer anyone who connects: docs/security.md).

    ns = Namespace.make()                    # raises CannotIsolate where the system refuses
    value = ns.run(start_rpc)                # on a thread inside it: its sockets, its threads
    env[NETNS_ENV] = ns.path                 # a worker started with it enters first thing
    enter_from_env()                         # (what ``python -m somatize.remote`` does)

A network namespace belongs to a thread, not a process: the coordinator makes one on a
thread of its own and starts RPC there, so every TensorPipe thread and socket is inside,
while the rest of the process (a data loader's downloads, a logger) stays where it was.
Making one needs CAP_SYS_ADMIN in the process's user namespace: root, a container, or an
unprivileged user's own user namespace (``unshare --user --map-current-user --keep-caps
python train.py``, where the kernel allows them).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading

CLONE_NEWNET = 0x40000000
NETNS_ENV = "SOMATIZE_NETNS"  # /proc/<coordinator>/fd/<n>: the run's namespace
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH14x"


class CannotIsolate(OSError):
    """This system does not let the run have a network namespace of its own."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> None:
    if getattr(_libc(), name)(*args) != 0:
        e = ctypes.get_errno()
        raise CannotIsolate(e, f"{name}(CLONE_NEWNET): {os.strerror(e)}")


def _loopback_up() -> None:
    # a fresh namespace's loopback is down; a socket made on this thread is inside it
    with socket.socket() as s:
        got = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
        flags = struct.unpack(_IFREQ, got)[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


class Namespace:
    """A network namespace of this run's, held open by a descriptor of this process."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def make(cls) -> Namespace:
        """A fresh network namespace with its loopback up (CannotIsolate where refused)."""
        got: list = []

        def inside():
            try:
                _call("unshare", CLONE_NEWNET)
                _loopback_up()
                got.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                got.append(e if isinstance(e, CannotIsolate) else CannotIsolate(
                    e.errno or errno.EPERM, f"bringing up its loopback: {e}"))

        t = threading.Thread(target=inside, name="somatize-netns")  # it ends with the thread
        t.start()
        t.join()
        if isinstance(got[0], Exception):
            raise got[0]
        return cls(got[0])

    @property
    def path(self) -> str:
        """What another process of this user opens to enter it."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    @property
    def inode(self) -> str:
        return os.readlink(f"/proc/self/fd/{self.fd}")

    def run(self, fn, *args):
        """``fn(*args)`` on a fresh thread inside the namespace (what it creates, sockets
        and threads, is inside too); returns what it returns, raises what it raises."""
        got: list = []

        def inside():
            try:
                _call("setns", self.fd, CLONE_NEWNET)
                got.append((True, fn(*args)))
            except BaseException as e:  # raised on the caller's thread
                got.append((False, e))

        t = threading.Thread(target=inside, name="somatize-rpc-start")
        t.start()
        t.join()
        ok, value = got[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        os.close(self.fd)


def enter_from_env() -> None:
    """Enter the run's namespace that this process's environment names (``NETNS_ENV``),
    before it makes any socket: an embedded worker of an isolated run."""
    given = os.environ.pop(NETNS_ENV, None)
    if not given:
        return
    path, _, inode = given.partition("#")  # a daemon's child is told which it must be
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if inode and os.readlink(f"/proc/self/fd/{fd}") != inode:
                raise CannotIsolate(errno.ESRCH, f"{path} is no longer the run's ({inode})")
            _call("setns", fd, CLONE_NEWNET)
        finally:
            os.close(fd)
    except OSError as e:
        raise SystemExit(
            f"somatize: this worker cannot enter its run's network namespace {path} ({e}): "
            "a worker on the coordinator's machine must run as its user, with the same "
            "capabilities; or start the coordinator with configure(isolate='off')") from None
