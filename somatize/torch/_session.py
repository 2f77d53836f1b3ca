"""What one run of placed work shares, whichever route drives it: the runtime and its
workers, the keeper, the math settings that travel, the account of which process ran
what, calls to a host, and close. The graph's staged step (``Step``) and the submodules
placed by name (the Lightning strategy's placed route) both stand on a ``Session``, so a
refusal they share is written once, here.

    session = Session(graph, workers={"gpu": Worker.at("127.0.0.1:7000")}, store=None)
    session.follow_math()                  # before the first call of a step
    session.call("gpu", fn, *args)         # fn(live_graph, *args) over there
    session.account.add("body", pid)       # which process ran "body"
    session.where(); session.traffic(); session.close()
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _holes
from .._errors import Refused, WorkerError, check_workers
from .._graph import Graph
from ._math import math_flags, set_math_live


def refuse_devices(asked: Any, devices: int, nodes: int) -> None:
    """Refuse more than one device or node here: the placed work's workers are the run's
    other processes, not data-parallel replicas."""
    if devices > 1 or nodes > 1:
        raise Refused(
            f"SomatizeStrategy drives one device here (devices={asked}, num_nodes={nodes} "
            "given): the placed modules' workers are its other processes. Use "
            "lightning.Trainer(devices=1) and place more modules on more workers, or run data "
            "parallel under another strategy")


def lost_error(cause: str, resume: str) -> WorkerError:
    """The error for trained state lost with its worker: ``cause`` (the first line of what
    the transport said) and ``resume`` (what to do, in the route's own words)."""
    return WorkerError(
        f"no checkpoint is written: the weights and optimizer state trained over there were "
        f"lost with their worker ({cause}), and the copy here is stale. {resume}")


class Account:
    """Which process ran each node (or placed module), and how often, under one lock:
    a pipeline's stages are answered on other threads."""

    def __init__(self):
        self._ran: dict[str, Counter] = {}
        self._lock = threading.Lock()

    def add(self, name: str, pid: int, times: int = 1) -> None:
        """``name`` ran ``times`` more in process ``pid``."""
        with self._lock:
            self._ran.setdefault(name, Counter())[pid] += times

    def count(self, pids: Mapping[Any, int], name_of=str) -> None:
        """Add one run per entry of ``{what ran: pid}``, named by ``name_of(what)``."""
        with self._lock:
            for n, pid in pids.items():
                self._ran.setdefault(name_of(n), Counter())[pid] += 1

    def where(self) -> dict[str, dict[int, int]]:
        """``{name: {pid: times}}``, a copy."""
        with self._lock:
            return {n: dict(c) for n, c in self._ran.items()}


class Session:
    """The workers ``graph``'s placed nodes run on, and what a run over them shares.

    Args:
        graph: the graph that runs (its placement names the hosts); its runtime is this
            session's own, so the session over there is this run's alone.
        workers: ``{host: Worker}``; embedded ones (or torchrun's ranks) when not given.
        store: a directory or Keeper where ``.cached()`` nodes are kept.
    """

    def __init__(self, graph: Graph, *, workers: Mapping[str, Any] | None = None,
                 store: Any = None):
        check_workers(workers)
        self.graph = graph
        self.keeper = _holes.keeper(store)
        self.account = Account()
        self.runtime: Any = None
        if graph.placement.hosts:
            self.runtime = _holes.transport().runtime_for(graph, workers)
            self.runtime.provision(graph)
        self._math: dict[str, tuple] = {}  # per host: the math settings as last sent
        self._math_sent: list = []  # those calls, answered or not

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts this session's graph places work on."""
        return tuple(self.graph.placement.workers())

    def follow_math(self, hosts: Iterable[str] | None = None) -> None:
        """Send each worker this process's math settings (threads, TF32, deterministic
        algorithms...) when they changed since: an ordered call, so it runs over there
        before what is sent after it. A Worker given its own threads keeps them."""
        if self.runtime is None:
            return
        for host in self.hosts if hosts is None else hosts:
            flags = math_flags(threads=self.runtime.spec(host).threads is None)
            if self._math.get(host) != flags:
                self._math[host] = flags
                self._math_sent.append(self.runtime.call_async(host, set_math_live, flags))
        while self._math_sent and self._math_sent[0].fut.done():
            self._math_sent.pop(0).result()  # raises what went wrong over there

    def call(self, host: str, fn: Any, *args: Any) -> Any:
        """Run ``fn(live_graph, *args)`` on ``host``'s worker; return what it returns."""
        return self.runtime.call(host, fn, *args)

    def call_async(self, host: str, fn: Any, *args: Any) -> Any:
        """``call`` without waiting: ``.result()`` answers."""
        return self.runtime.call_async(host, fn, *args)

    def where(self) -> dict[str, dict[int, int]]:
        """Which processes ran each node, and how often: ``{node: {pid: times}}``."""
        return self.account.where()

    def traffic(self) -> tuple[float, int, int]:
        """Seconds this process waited on workers, bytes sent, bytes received, so far."""
        rt = self.runtime
        return (0.0, 0, 0) if rt is None else (rt.waited, rt.sent, rt.received)

    @property
    def closed(self) -> bool:
        """Whether the run over there is over (closed, or stopped by Ctrl-C)."""
        return self.runtime is None or getattr(self.runtime, "closed", False)

    def close(self) -> None:
        """Stop the workers this session started (nobody else uses); idempotent."""
        if self.runtime is not None:
            _holes.transport().release(self.graph)
            self.runtime = None
