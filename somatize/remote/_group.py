"""The one RPC group of this process: the coordinator is rank 0 and hosts the
rendezvous; worker processes join and leave it (dynamic membership), and are
shared by every runtime of the process, each runtime with its own session.

    configure(timeout=30, transports=["uv"])   # before the first run, if at all
    peer = group().peer("gpu", Worker())        # starts (or reuses) the worker

torch.distributed.rpc cannot be initialised twice in one process (pytorch#46491):
the agent is started once, at first use, and shut down at interpreter exit.

Transport: ``uv``, with TensorPipe's own channel choice, by measuring
(``scripts/bench_remote.py --compare``, 2-core VM): the default ``shm`` transport
has the cheapest calls (380 us vs 590 us) and transfers, but keeps a thread spinning
a core in every process, which doubled the worker's compute (10.3 vs 5.3 ms for an
MLP body) and lost the forward overall (2.4x here vs 1.5x); the ``mpt_uv`` channel
moves 64 MB five times faster (3.6 vs 0.7 GB/s) but 1 MB slower (1.0 vs 0.7 ms), and
activations are mostly small: ``configure(channels=["mpt_uv"])`` for big ones.
Processes started here get ``THP_MEM_ALLOC_ENABLE=1`` (huge pages: large tensors are
received faster; it must be set before torch is imported), ``OMP_WAIT_POLICY=PASSIVE``
(libgomp's default busy-waits ~3 ms after every op, on the cores the coordinator computes
on: on the 2-core VM with other processes busy, a split step of ``bench_split.py``'s MLP
took 150-163 ms with the worker's threads spinning and 39-54 ms with them asleep) and
``TP_SOCKET_IFNAME=lo``;
the rendezvous is ours so that it too listens on loopback only (torch's ``tcp://``
listens on every interface).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .._errors import WorkerError
from ._worker import DEFAULT_TIMEOUT, Worker

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"
_settings: dict[str, Any] = {
    "listen": "127.0.0.1",  # where the rendezvous and the coordinator listen
    "transports": ["uv"],
    "channels": None,  # TensorPipe's own choice
    "rpc_threads": 16,
    "timeout": DEFAULT_TIMEOUT,
}


def configure(**settings: Any) -> None:
    """Set the group's transport options before the first run starts it.

    Args:
        listen: the address the coordinator binds (``"127.0.0.1"``); workers on other
            machines need one they can reach (and ``TP_SOCKET_IFNAME`` set to its
            interface).
        transports: TensorPipe transports, e.g. ``["uv"]`` or ``["shm", "uv"]``.
        channels: TensorPipe channels, e.g. ``["basic"]`` (None: TensorPipe's choice).
        rpc_threads: threads each process serves calls with.
        timeout: seconds a join or a shutdown may take.
    """
    unknown = set(settings) - set(_settings)
    if unknown:
        raise WorkerError(f"configure() knows {sorted(_settings)}, not {sorted(unknown)}")
    if _group is not None and _group.started:
        raise WorkerError("configure() must be called before the first run starts RPC in "
                          "this process (it cannot be restarted: pytorch#46491)")
    _settings.update(settings)


def backend_options(init_method: str, opts: dict):
    """The TensorPipe options every process of the group is started with."""
    import torch.distributed.rpc as rpc

    kw: dict[str, Any] = {}
    if opts.get("transports"):
        kw["_transports"] = list(opts["transports"])
    if opts.get("channels"):
        kw["_channels"] = list(opts["channels"])
    return rpc.TensorPipeRpcBackendOptions(
        init_method=init_method, num_worker_threads=opts.get("rpc_threads", 16),
        rpc_timeout=opts.get("timeout", DEFAULT_TIMEOUT), **kw)


@dataclass
class Peer:
    """A worker process in the group, shared by the runtimes that use it."""

    name: str  # its RPC name
    host: str  # the host name the graph places nodes on
    kind: str
    timeout: float
    proc: subprocess.Popen | None = None
    conn: socket.socket | None = None  # to a standing daemon, held for the run
    keeps: bool = False
    pid: int | None = None
    rank: int | None = None
    users: int = 0
    dead: str | None = None  # why it is gone, once it is
    key: tuple = field(default=())

    def why_dead(self) -> str | None:
        """Why this worker is gone (None while it may be alive)."""
        if self.dead is None and self.proc is not None and self.proc.poll() is not None:
            self.dead = f"its process (pid {self.proc.pid}) exited with code {self.proc.returncode}"
        return self.dead


class Group:
    """This process's RPC agent and the worker processes it knows."""

    def __init__(self):
        self.started = False
        self.static: dict[str, int] | None = None  # torchrun: rank of each host
        self.world = 0
        self.join = ""
        self.next_rank = 1
        self.taken: set[str] = {COORDINATOR}
        self.peers: dict[tuple, Peer] = {}
        self.lock = threading.RLock()
        self.runtimes: weakref.WeakSet = weakref.WeakSet()

    # -- the agent ----------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            if self.started:
                return
            import torch.distributed.rpc as rpc

            if self.static is not None:  # torchrun: every rank is known, MASTER_* set
                rpc.init_rpc(COORDINATOR, rank=0, world_size=self.world,
                             rpc_backend_options=backend_options("env://", _settings))
            else:
                host = _settings["listen"]
                if _loopback(host) and "TP_SOCKET_IFNAME" not in os.environ:
                    os.environ["TP_SOCKET_IFNAME"] = _loopback_iface()
                port = self._rendezvous(host)
                self.join = f"tcp://{host}:{port}"
                rpc.init_rpc(COORDINATOR, rank=0, world_size=None,
                             rpc_backend_options=backend_options(f"somatize://{host}:{port}",
                                                                 _settings))
                expect_closed_pipes()
            self.started = True
            atexit.register(self.shutdown)
            log.debug("RPC group started (%s)", self.join or "torchrun")

    def _rendezvous(self, host: str) -> int:
        # torch's tcp:// rendezvous listens on every interface; ours binds where we say
        import importlib
        from datetime import timedelta

        import torch.distributed as dist


        self._socket = socket.create_server((host, 0), backlog=128)
        port = self._socket.getsockname()[1]
        self._store = dist.TCPStore(host, port, None, True, timedelta(seconds=_settings["timeout"]),
                                    wait_for_workers=False, master_listen_fd=self._socket.fileno())

        def handler(url, **kw):
            yield self._store, 0, -1

        # the module, not the function torch.distributed re-exports under the same name
        rdv = importlib.import_module("torch.distributed.rendezvous")
        rdv.register_rendezvous_handler("somatize", handler)
        return port

    def names(self) -> set[str]:
        from torch.distributed.rpc.api import _get_current_rpc_agent

        return {w.name for w in _get_current_rpc_agent().get_worker_infos()}

    # -- workers ------------------------------------------------------------------
    def peer(self, host: str, spec: Worker) -> Peer:
        """The worker process serving ``host`` as ``spec`` says, started if need be."""
        self.start()
        key = (spec.kind, spec.address or spec.torchrun_rank or (host, spec.store, spec.threads))
        with self.lock:
            p = self.peers.get(key)
            if p is not None and p.why_dead() is None:
                p.users += 1
                return p
            if spec.kind == "torchrun":
                p = self._ranked(host, spec)
            else:
                p = self._spawn(host, spec)
            p.key = key
            p.users += 1
            self.peers[key] = p
            return p

    def _name(self, host: str) -> str:
        # TensorPipe lists a dynamic group's members as "name-rank," and splits at the
        # first '-': a name with one is read as another (a later joiner greets a stranger)
        base = host.replace("-", "_")
        name, k = base, 1
        while name in self.taken:  # an RPC name is never reused in one group
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def _ranked(self, host: str, spec: Worker) -> Peer:
        if self.static is None:
            raise WorkerError(
                f"Worker.rank({spec.torchrun_rank}) for host {host!r}, but this process was not "
                "started by torchrun: call somatize.remote.serve_if_worker() first thing in "
                "the script, and launch it with torchrun --nproc-per-node=N"
            )
        from torch.distributed.rpc.api import _get_current_rpc_agent

        by_rank = {w.id: w.name for w in _get_current_rpc_agent().get_worker_infos()}
        if spec.torchrun_rank not in by_rank:
            raise WorkerError(
                f"host {host!r} is served by rank {spec.torchrun_rank}, but the run has ranks "
                f"{sorted(by_rank)}: launch with --nproc-per-node={spec.torchrun_rank + 1} or more"
            )
        return Peer(by_rank[spec.torchrun_rank], host, "torchrun", spec.timeout)

    def _spawn(self, host: str, spec: Worker) -> Peer:
        name, rank = self._name(host), self.next_rank
        self.next_rank += 1
        cmd = ["--name", name, "--rank", str(rank), "--join", self.join,
               "--options", json.dumps({k: v for k, v in _settings.items() if k != "listen"}),
               "--threads", str(spec.threads or _threads_here())]
        if spec.kind == "standing":
            p = Peer(name, host, "standing", spec.timeout, rank=rank)
            p.conn, reply = _ask_daemon(spec.address, host, cmd, spec.timeout)
            p.pid = reply.get("pid")
        else:
            if spec.store is not None:
                cmd += ["--store", spec.store]
            p = Peer(name, host, "embedded", spec.timeout, rank=rank)
            if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
                log.info("worker %r shares this machine's cores: start this process with "
                         "OMP_WAIT_POLICY=PASSIVE (before torch is imported) so that its idle "
                         "math threads sleep instead of spinning while the worker computes "
                         "(scripts/bench_split.py --spin shows the difference)", host)
            p.proc = subprocess.Popen([sys.executable, "-m", "somatize.remote", *cmd],
                                      stdin=subprocess.PIPE, env=_child_env())
            p.pid = p.proc.pid
        return p

    def wait_joined(self, peers: list[Peer]) -> None:
        """Wait until each of ``peers`` has joined the group (or say why it did not)."""
        todo = [p for p in peers if p.kind != "torchrun"]
        start = time.monotonic()
        from ._serve import _joined

        while todo:
            todo = [p for p in todo if p.name not in _joined]
            for p in todo:
                if p.why_dead() is not None:
                    self._drop(p)
                    raise WorkerError(
                        f"worker {p.host!r} ({p.kind}) did not join the run: {p.dead}; its "
                        "stderr is above"
                    )
                if time.monotonic() - start > _settings["timeout"]:
                    self.stop(p, force=True)
                    raise WorkerError(
                        f"worker {p.host!r} ({p.kind}) did not join the run within "
                        f"{_settings['timeout']:g} s: check that it can reach {self.join}, "
                        "or raise somatize.remote.configure(timeout=...)"
                    )
            if todo:
                time.sleep(0.02)

    def release(self, p: Peer) -> None:
        """One runtime is done with ``p``; the last one stops it (torchrun ranks stay)."""
        with self.lock:
            p.users -= 1
            if p.users <= 0 and p.kind != "torchrun":
                self.stop(p)

    def stop(self, p: Peer, force: bool = False) -> None:
        """Ask the worker to leave and exit; kill it if it does not, in bounded time."""
        import torch.distributed.rpc as rpc

        from . import _serve

        self._drop(p)
        if p.why_dead() is None and not force:
            try:
                rpc.rpc_sync(p.name, _serve.stop, timeout=min(p.timeout, 10.0))
            except Exception as e:
                log.warning("worker %r did not take the stop: %s", p.host, e)
                force = True
        if p.proc is not None:
            if p.proc.stdin:
                p.proc.stdin.close()
            try:
                p.proc.wait(timeout=0.1 if force else min(p.timeout, 20.0))
            except subprocess.TimeoutExpired:
                log.warning("worker %r (pid %d) did not exit: killing it", p.host, p.proc.pid)
                p.proc.kill()
                p.proc.wait(timeout=10)
        elif p.kind == "standing" and not force:
            deadline = time.monotonic() + min(p.timeout, 20.0)
            while p.name in self.names() and time.monotonic() < deadline:
                time.sleep(0.02)
        if p.conn is not None:  # the daemon ends whatever is left of this run
            p.conn.close()
            p.conn = None
        if p.why_dead() is not None or force:
            self.forget(p)

    def forget(self, p: Peer) -> None:
        """Take a dead worker out of the group, so later ones can still join."""
        try:
            from torch.distributed.rpc.api import _get_current_rpc_agent

            agent = _get_current_rpc_agent()
            info = agent.get_worker_info(p.name)
            agent._update_group_membership(info, [], {}, False)
        except Exception as e:  # it may never have joined
            log.debug("forgetting %r: %s", p.name, e)
        if self.static is None and p.rank is not None:
            # a joining worker greets everyone listed here: a dead one would fail its join
            # (the list's key and format are TensorPipe's, agent_utils.cpp)
            key = "rpc_prefix_0/names/_ALL_WORKER_INFOS"
            try:
                listed = "," + self._store.get(key).decode()
                self._store.set(key, listed.replace(f",{p.name}-{p.rank},", ",")[1:])
            except Exception as e:
                log.debug("unlisting %r: %s", p.name, e)

    def _drop(self, p: Peer) -> None:
        with self.lock:
            if self.peers.get(p.key) is p:
                del self.peers[p.key]

    def shutdown(self) -> None:
        """Close every runtime, stop every worker, leave RPC (at interpreter exit)."""
        import torch.distributed.rpc as rpc

        for rt in list(self.runtimes):
            try:
                rt.close()
            except Exception as e:
                log.warning("closing a runtime at exit: %s", e)
        for p in list(self.peers.values()):
            if p.kind != "torchrun":
                self.stop(p)
        if self.started:
            self.started = False
            try:
                # a torchrun group ends together; a dynamic one has nobody left to wait for
                rpc.shutdown(graceful=self.static is not None, timeout=_settings["timeout"])
            except Exception as e:
                log.warning("RPC shutdown: %s", e)


def expect_closed_pipes() -> None:
    """Tell this process's agent (of a dynamic group) that peers leaving is normal.

    TensorPipe warns on stderr about every incoming pipe that closes ("encountered error
    when reading incoming request from gpu: EOF", tensorpipe_agent.cpp) unless the agent
    has left the group, which is the only thing that sets its ``shuttingDown_``; so each
    process leaves once, right after joining, and lists itself again. It still serves and
    calls as before; a peer that is lost is said by our errors, which name it.
    """
    from torch.distributed.rpc.api import _get_current_rpc_agent

    agent = _get_current_rpc_agent()
    me, store = agent.get_worker_info(), agent.store
    # the token torch's joins and leaves hold (rpc/_utils.py), so none happens meanwhile;
    # waited for by polling, not store.wait: a member waiting must still answer the joiner
    token, mine = "RpcGroupManagementToken", f"Token_for_{me.name}_listed"
    deadline = time.monotonic() + _settings["timeout"]
    while store.compare_set(token, "", mine).decode() != mine:
        if time.monotonic() > deadline:
            raise WorkerError(f"{me.name!r} waited {_settings['timeout']:g} s for the group's "
                              "membership token: another process holds it (a join that hung)")
        time.sleep(0.005)
    try:
        key = "names/_ALL_WORKER_INFOS"  # TensorPipe's list of members (agent_utils.cpp)
        agent.join(shutdown=True)  # unlists us
        store.set(key, store.get(key).decode() + f"{me.name}-{me.id},")
    finally:
        store.set(token, "")
        store.set(mine, "Done")  # whoever waits for our token (torch's joins) goes on


_group: Group | None = None


def group() -> Group:
    """This process's group (not started until a worker is needed)."""
    global _group
    if _group is None:
        _group = Group()
    return _group


def _threads_here() -> int:
    import torch

    return torch.get_num_threads()


# what a serving process starts with unless the environment says otherwise (both are read
# once, before torch is imported, so only a process somatize starts can be given them):
# huge pages, so large tensors are received faster; and math threads that sleep as soon as
# a node is done instead of spinning for milliseconds (libgomp's default), because the
# coordinator computes on the same cores while the worker waits, and back
SERVING_ENV = {"THP_MEM_ALLOC_ENABLE": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def serving_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``SERVING_ENV``'s settings where it says nothing of them."""
    return {**SERVING_ENV, **env}


def _child_env() -> dict[str, str]:
    env = serving_env(dict(os.environ))
    env["TP_SOCKET_IFNAME"] = os.environ.get("TP_SOCKET_IFNAME") or _loopback_iface()
    # what imports here imports there: the script's directory and every path of this process
    paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _ask_daemon(address: str, host: str, cmd: list[str], timeout: float):
    where, _, port = address.rpartition(":")
    if not _loopback(where) and _loopback(_settings["listen"]):
        raise WorkerError(
            f"worker {host!r} at {address} is on another machine, but this coordinator "
            "listens on loopback only: call somatize.remote.configure(listen='<an address "
            "it can reach>') and set TP_SOCKET_IFNAME to that interface"
        )
    try:
        conn = socket.create_connection((where, int(port)), timeout=timeout)
        conn.sendall(json.dumps({"serve": cmd}).encode() + b"\n")
        line = conn.makefile("rb").readline()
        reply = json.loads(line or b"{}")
    except (OSError, ValueError) as e:
        raise WorkerError(
            f"worker {host!r}: no standing worker answered at {address} ({e}). Start one "
            f"there with `python -m somatize.worker --name {host} --listen {address}`"
        ) from None
    if "error" in reply or "pid" not in reply:
        conn.close()
        raise WorkerError(f"worker {host!r} at {address} refused the run: "
                          f"{reply.get('error', 'no answer')}")
    conn.settimeout(None)
    return conn, reply


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _loopback_iface() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"

