"""A run that listens on a network admits only its own hosts: each TensorPipe listener of
its processes gets a kernel socket filter that drops every connection from an address
that is not one of the run's (docs/security.md, "A run across machines").

    with opening(["198.18.0.1"]):            # each listener opened inside is filtered
        rpc.init_rpc(...)                    # (TensorPipe's): these hosts may connect
    allow(["198.18.0.2"])                    # a host proven at the gate joins the run

TensorPipe answers anyone who connects (built-in operators run, junk aborts the process);
it has no hook to refuse a peer. A classic BPF program attached with ``SO_ATTACH_FILTER``
needs no privilege; on a listener it drops the SYN of a source not listed, so a stranger
gets no connection at all, and the connections it accepts inherit it. The coordinator
learns each host at its gate, after the host proved it holds the run's key, and tells
every member before the new one can connect to any of them (``Admitted``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import struct
import threading

from .._errors import WorkerError

log = logging.getLogger(__name__)

KEY = "somatize/admitted"  # in the rendezvous: the run's hosts, comma-separated
SO_ATTACH_FILTER = 26
_NET = -0x100000  # SKF_NET_OFF: offsets from the IP header, for a TCP socket's filter
_LDB, _LDW, _RSH, _JEQ, _RET = 0x30, 0x20, 0x74, 0x15, 0x06

_lock = threading.Lock()
_hosts: set[str] = set()  # the addresses that may connect
_guarded: dict[int, int] = {}  # fd -> socket inode: the listeners filtered


def _own_socket(fd: int) -> socket.socket | None:
    # a socket object of our own on a copy of ``fd``: closing it leaves ``fd`` as it was
    try:
        copy = os.dup(fd)
    except OSError:
        return None  # closed meanwhile
    try:
        return socket.socket(fileno=copy)
    except OSError:
        os.close(copy)  # not a socket (the number was reused meanwhile)
        return None


def listening() -> dict[int, int]:
    """This process's TCP listening sockets: socket inode -> descriptor."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:["):
                continue
        except OSError:
            continue
        s = _own_socket(int(name))
        if s is None:
            continue
        with s:
            if (s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                    and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                out[os.fstat(s.fileno()).st_ino] = int(name)
    return out


def _address(host: str) -> str:
    a = ipaddress.ip_address(host.strip("[]"))
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped:
        a = a.ipv4_mapped
    return str(a)


def program(hosts) -> list[tuple[int, int, int, int]]:
    """The filter: keep a packet whose IPv4 or IPv6 source is one of ``hosts``."""
    v4 = sorted(int(a) for a in map(ipaddress.ip_address, hosts) if a.version == 4)
    v6 = sorted(int(a) for a in map(ipaddress.ip_address, hosts) if a.version == 6)
    prog4 = [(_LDW, 0, 0, _NET + 12)]
    for a in v4:
        prog4 += [(_JEQ, 0, 1, a), (_RET, 0, 0, 0xFFFFFFFF)]
    prog4.append((_RET, 0, 0, 0))
    if len(prog4) > 255:
        raise WorkerError(f"a run of {len(v4)} hosts: somatize filters at most 126 IPv4 "
                          "addresses on a listener; configure(isolate='off') to filter none")
    prog = [(_LDB, 0, 0, _NET), (_RSH, 0, 0, 4), (_JEQ, 0, len(prog4), 4), *prog4]
    for a in v6:
        words = [(a >> (96 - 32 * i)) & 0xFFFFFFFF for i in range(4)]
        for i, w in enumerate(words):  # all four words equal, or on to the next address
            prog += [(_LDW, 0, 0, _NET + 8 + 4 * i), (_JEQ, 0, 7 - 2 * i, w)]
        prog.append((_RET, 0, 0, 0xFFFFFFFF))
    return prog + [(_RET, 0, 0, 0)]


def _attach(fd: int, prog) -> None:
    code = (ctypes.c_uint8 * (8 * len(prog)))()
    for i, (op, jt, jf, k) in enumerate(prog):
        struct.pack_into("HBBI", code, 8 * i, op, jt, jf, k & 0xFFFFFFFF)
    fprog = struct.pack("HL", len(prog), ctypes.addressof(code))
    s = _own_socket(fd)
    if s is None:
        return  # closed meanwhile
    with s:
        s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def _install() -> None:
    prog = program(_hosts)
    for fd, inode in list(_guarded.items()):
        try:
            if os.fstat(fd).st_ino != inode:
                raise OSError("reused")
        except OSError:
            del _guarded[fd]  # TensorPipe closed it
            continue
        _attach(fd, prog)


def allow(hosts) -> bool:
    """Let ``hosts`` connect to the guarded listeners; True when one was new."""
    new = {_address(h) for h in hosts if h} - _hosts
    if not new:
        return False
    with _lock:
        _hosts.update(new)
        _install()
    return True


def hosts() -> list[str]:
    return sorted(_hosts)


def guard(listeners: dict[int, int], hosts) -> None:
    """Filter ``listeners`` (inode -> descriptor) so that only ``hosts``, the listeners'
    own addresses and later ``allow``-ed ones connect; a connection they accepted before
    from anywhere else is cut."""
    own = []
    for fd in listeners.values():
        s = _own_socket(fd)
        if s is not None:
            with s:
                own.append(s.getsockname()[0])
    with _lock:
        _hosts.update(_address(h) for h in [*hosts, *own] if h and h not in ("0.0.0.0", "::"))
        _guarded.update({fd: inode for inode, fd in listeners.items()})
        _install()
        ports = {p for fd in listeners.values() if (p := _port(fd))}
        _cut(ports)
    log.debug("listeners %s admit only %s", sorted(ports), sorted(_hosts))


def _port(fd: int) -> int | None:
    s = _own_socket(fd)
    if s is None:
        return None
    with s:
        return s.getsockname()[1]


def _cut(ports: set[int]) -> None:
    # connections accepted before the filter was on: those from outside the run end here
    for name in os.listdir("/proc/self/fd"):
        s = _own_socket(int(name))
        if s is None:
            continue
        with s:
            try:
                if s.type != socket.SOCK_STREAM or s.getsockname()[1] not in ports:
                    continue
                peer = _address(s.getpeername()[0])
            except (OSError, ValueError, IndexError):
                continue  # a listener, a unix socket, not connected
            if peer not in _hosts:
                log.warning("cut a connection from %s to this run's listener (port %d): it "
                            "came before the filter that admits only the run's hosts", peer,
                            s.getsockname()[1])
                s.shutdown(socket.SHUT_RDWR)


class Admitted:
    """The coordinator's side: each host proven at the gate is allowed here, written in
    the rendezvous (``KEY``) and told to every member before the new one can connect."""

    def __init__(self, store, members):
        self.store, self.members = store, members  # members(): the workers' RPC names

    def __call__(self, host: str) -> None:
        try:
            if not allow([host]):
                return
        except ValueError as e:  # not an address: what the gate saw of it is admitted
            log.debug("admitting %r: %s", host, e)
            return
        self.store.set(KEY, ",".join(hosts()))
        import torch.distributed.rpc as rpc

        calls = [(n, rpc.rpc_async(n, allow, args=([host],), timeout=10))
                 for n in self.members()]
        for name, call in calls:
            try:
                call.wait()
            except Exception as e:  # a member that is gone connects to nobody
                log.debug("telling %r that %s joins: %s", name, host, e)


@contextlib.contextmanager
def opening(hosts, later=None):
    """Guard each listener this process opens inside the block (TensorPipe's, in
    ``init_rpc``) as it appears, polled every 2 ms, and all of them once more at the end,
    with the hosts ``later()`` says then too: a connection made before its filter is on is
    cut. ``hosts=None``: guard nothing."""
    if hosts is None:
        yield
        return
    before, seen, done = set(listening()), set(), threading.Event()

    def new() -> dict[int, int]:
        return {i: fd for i, fd in listening().items() if i not in before | seen}

    def watch():
        while not done.wait(0.002):
            if got := new():
                seen.update(got)
                guard(got, hosts)

    t = threading.Thread(target=watch, daemon=True, name="somatize-admit")
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        # a host that joined while we did: admitted before we were a member to be told
        more = (later() or []) if later is not None else []
        guard({**{i: fd for i, fd in listening().items() if i in seen}, **new()},
              [*hosts, *more])


def run_hosts(store) -> list[str] | None:
    """The run's hosts, as the coordinator wrote them in the rendezvous (``KEY``); None
    for a run that admits anyone (on loopback, or ``isolate="off"``)."""
    return store.get(KEY).decode().split(",") if store.check([KEY]) else None


def coordinator_side(gate, members) -> None:
    """From now on the gate admits each proven joiner's address (``Admitted``); the hosts
    so far (this one's) go in the rendezvous, for joiners to read."""
    gate.admit = Admitted(gate.store, members)
    gate.store.set(KEY, ",".join(hosts()))
