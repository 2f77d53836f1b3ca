"""The one RPC group of this process: the coordinator is rank 0 and hosts the
rendezvous; worker processes join and leave it (dynamic membership), and are shared by
every runtime of the process, each runtime with its own session.

    peer = group().peer("gpu", Worker())        # starts (or reuses) the worker
    group().wait_joined([peer]); group().release(peer)

torch.distributed.rpc cannot be initialised twice in one process (pytorch#46491): the
agent is started once, at first use, and shut down at interpreter exit. Settings are
``_settings``'s, membership surgery ``_membership``'s, process starts ``_spawn``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import subprocess
import threading
import time
import weakref

from .._errors import WorkerError
from . import _admit, _exposure, _membership, _private, _sealed, _secret
from ._death import process_state
from ._peer import Peer
from ._settings import (
    COORDINATOR,
    _started,
    backend_options,
    keep_on_loopback,
    loopback,
    settings,
    worker_options,
)
from ._spawn import ask_daemon, spawn
from ._worker import Worker

log = logging.getLogger(__name__)


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
        self.holds = 0  # keep_workers() blocks open: a worker nobody uses waits for the next
        self.netns = None  # the run's network namespace (_isolation.Namespace), if any

    # -- the agent ----------------------------------------------------------------
    def start(self, specs=()) -> None:
        """Start this process's agent (once); ``specs``: the workers the first run asks
        for, which say whether its listeners can be kept to the run (``_exposure``)."""
        with self.lock:
            if self.started:
                return
            import torch.distributed.rpc as rpc

            if self.static is not None:  # torchrun: every rank is known, MASTER_* set
                from ._torchrun_rendezvous import drop_key_file, rendezvous

                _exposure.isolate(os.environ.get("MASTER_ADDR", "127.0.0.1"), specs,
                                  torchrun=True)
                init = rendezvous(0)  # somatize's own, gated; never torchrun's store
                rpc.init_rpc(COORDINATOR, rank=0, world_size=self.world,
                             rpc_backend_options=backend_options(init, settings))
                drop_key_file()  # every rank has joined: each has read it
            else:
                host = settings["listen"]
                if loopback(host):
                    keep_on_loopback()
                key = _secret.run_key()
                _sealed.seal(key, loopback(host))  # before the first message: its MAC
                self.netns = _exposure.isolate(host, specs)
                network = not loopback(host) and settings["isolate"] != "off"

                def begin():  # inside the run's namespace, where there is one
                    gate = _membership.rendezvous(host, key, settings["timeout"])
                    with _admit.opening([] if network else None):  # admit only its hosts
                        rpc.init_rpc(COORDINATOR, rank=0, world_size=None,
                                     rpc_backend_options=backend_options(
                                         f"somatize://{host}:{gate.port}", settings))
                        _membership.expect_closed_pipes(settings["timeout"])
                    if network:
                        _admit.coordinator_side(gate, lambda: self.names() - {COORDINATOR})
                    return gate

                self._gate = self.netns.run(begin) if self.netns else begin()
                self._store = self._gate.store
                self.join = f"tcp://{host}:{self._gate.port}"
            self.started = _started[0] = True
            atexit.register(self.shutdown)
            log.debug("RPC group started (%s)", self.join or "torchrun")

    def names(self) -> set[str]:
        return {w.name for w in _private.worker_infos()}

    # -- workers ------------------------------------------------------------------
    def peer(self, host: str, spec: Worker) -> Peer:
        """The worker process serving ``host`` as ``spec`` says, started if need be."""
        self.start([spec])
        key = (spec.kind, spec.address or spec.torchrun_rank or (host, spec.store, spec.threads),
               spec.device)
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
        by_rank = {w.id: w.name for w in _private.worker_infos()}
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
               "--options", json.dumps(worker_options()),
               "--threads", str(spec.threads or _threads_here())]
        if spec.device is not None:
            cmd += ["--device", spec.device]
        if spec.kind == "standing":
            p = Peer(name, host, "standing", spec.timeout, rank=rank)
            request = {"name": name, "rank": rank, "join": self.join,
                       "options": worker_options(),
                       "threads": spec.threads or _threads_here(), "device": spec.device}
            if self.netns is not None:  # its serving process enters the run's namespace
                request["netns"] = {"path": self.netns.path, "inode": self.netns.inode}
            p.conn, reply = ask_daemon(spec.address, host, request, spec.timeout)
            p.pid = reply.get("pid")
        else:
            if spec.store is not None:
                cmd += ["--store", spec.store]
            p = Peer(name, host, "embedded", spec.timeout, rank=rank)
            if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
                log.info("worker %r shares this machine's cores: start this process with "
                         "OMP_WAIT_POLICY=PASSIVE (before torch is imported) so that its idle "
                         "math threads sleep instead of spinning while the worker computes "
                         "(docs/performance.md)", host)
            p.proc = spawn(cmd, self.netns)
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
                if time.monotonic() - start > settings["timeout"]:
                    why = self._late(p)
                    self.stop(p, force=True)
                    raise WorkerError(f"worker {p.host!r} ({p.kind}) did not join the run "
                                      f"within {settings['timeout']:g} s: {why}")
            if todo:
                time.sleep(0.02)

    def _late(self, p: Peer) -> str:
        # not started in time, or cannot reach: the gate knows whom it has seen
        raise_it = "or raise somatize.remote.configure(timeout=...)"
        if p.proc is not None and process_state(p.proc.pid) == "T":
            return (f"its process (pid {p.proc.pid}) is stopped (SIGSTOP, Ctrl-Z or a "
                    "debugger holds it) and did not start in time")
        if self.static is None and p.name in self._gate.seen:
            return (f"it reached the rendezvous but did not finish joining: TensorPipe "
                    "could not connect one side to the other (set TP_SOCKET_IFNAME to an "
                    f"interface both reach), {raise_it}")
        if p.kind == "embedded":
            return (f"it did not start in time (it never reached the rendezvous at "
                    f"{self.join}: a slow start on a loaded machine?), {raise_it}")
        return (f"it never reached the rendezvous at {self.join} from its machine: check that "
                f"it can reach that address (configure(listen=...), a firewall), {raise_it}")

    def release(self, p: Peer) -> None:
        """One runtime is done with ``p``; the last one stops it (torchrun ranks stay)."""
        with self.lock:
            p.users -= 1
            if p.users <= 0 and p.kind != "torchrun" and not self.holds:
                self.stop(p)

    def hold(self) -> None:
        """Keep the workers nobody uses running (and joined) until ``let_go``."""
        with self.lock:
            self.holds += 1

    def let_go(self) -> None:
        """The end of a ``hold``: the last one stops the workers nobody uses."""
        with self.lock:
            self.holds -= 1
            if self.holds:
                return
            idle = [p for p in self.peers.values() if p.users <= 0 and p.kind != "torchrun"]
        for p in idle:
            self.stop(p)

    def kill(self, p: Peer, why: str) -> None:
        """Stop ``p`` now, waiting for nothing (Ctrl-C, or a call nobody will read):
        an embedded process is killed, a standing one's run is ended by its daemon;
        a torchrun rank is left to torchrun. Later calls to it say ``why``."""
        with self.lock:
            p.users -= 1
            if p.kind == "torchrun":
                return
            if p.dead is None:
                p.dead = why
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
            self.stop(p, force=True)

    def stop(self, p: Peer, force: bool = False) -> None:
        """Ask the worker to leave and exit; kill it if it does not, in bounded time."""
        import torch.distributed.rpc as rpc

        from . import _serve

        self._drop(p)
        force = force or p.unanswered  # a call to it timed out: do not wait on it again
        unanswered = None  # why the stop got no answer, if it got none
        if p.why_dead() is None and not force:
            try:
                rpc.rpc_sync(p.name, _serve.stop, timeout=min(p.timeout, 10.0))
            except Exception as e:
                # a worker that takes the stop may close its pipes before its answer is
                # out (EOF): it took it if it exits; only one that does not is said
                unanswered = e
                force = p.proc is None or process_state(p.proc.pid) == "T"  # (stopped)
        if p.proc is not None:
            if p.proc.stdin:
                p.proc.stdin.close()
            try:
                p.proc.wait(timeout=0.1 if force else min(p.timeout, 20.0))
                if unanswered is not None:
                    log.debug("worker %r left before its stop was answered (%s)", p.host,
                              unanswered)
            except subprocess.TimeoutExpired:
                log.warning("worker %r (pid %d) did not exit%s: killing it", p.host,
                            p.proc.pid, "" if unanswered is None else
                            f" (nor answer the stop: {unanswered})")
                p.proc.kill()
                p.proc.wait(timeout=10)
        elif unanswered is not None:
            log.warning("worker %r did not take the stop: %s", p.host, unanswered)
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
        _membership.forget(p.name)
        if self.static is None and p.rank is not None:
            _membership.unlist(self._store, p.name, p.rank)

    def _drop(self, p: Peer) -> None:
        with self.lock:
            if self.peers.get(p.key) is p:
                del self.peers[p.key]

    def shutdown(self) -> None:
        """Close every runtime, stop every worker, leave RPC (at interpreter exit)."""

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
            _leave(graceful=self.static is not None)
            _exposure.closing()  # how many calls and joins were refused, if any
            if self.netns is not None:
                self.netns.close()


def _leave(graceful: bool) -> None:
    # a torchrun group ends together; a dynamic one has nobody left to wait for. The
    # agent's own shutdown has no time limit (it waits for every RPC thread's work): it
    # is bounded here, and where it hangs is said, never waited on for ever
    import torch.distributed.rpc as rpc

    done = threading.Event()

    def leave():
        try:
            rpc.shutdown(graceful=graceful, timeout=settings["timeout"])
        except Exception as e:
            log.warning("RPC shutdown: %s", e)
        finally:
            done.set()

    try:
        threading.Thread(target=leave, daemon=True, name="somatize-rpc-shutdown").start()
    except RuntimeError:  # no new thread at interpreter exit (Python 3.12+): unbounded
        leave()
    limit = settings["timeout"] + 10.0  # a graceful one waits up to the timeout itself
    if not done.wait(limit):
        import faulthandler

        log.warning("RPC did not shut down within %g s: this process goes on without it "
                    "(where each thread is follows)", limit)
        faulthandler.dump_traceback(all_threads=True)


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


@contextlib.contextmanager
def keep_workers():
    """Keep each embedded or standing worker process running between the runs inside the
    block: a ``trainer.test`` after ``trainer.fit`` takes the fit's worker (each run still
    opens its own session over there) instead of starting one afresh.

        with keep_workers():
            trainer.fit(model, data)
            trainer.test(model, data)   # the same worker process, no second start
    """
    g = group()
    g.hold()
    try:
        yield
    finally:
        g.let_go()
