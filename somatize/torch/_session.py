"""What one run over workers shares, whichever route drives it: the workers, the math
settings that travel, the account of which process ran what, calls to a host, and close.
A fit under the Lightning strategy holds one ``Session``: each GraphModule's staged step
(``Step``) and the submodules placed by name (the placed route) are parts of it, so a
refusal they share is written once, here, and a Ctrl-C or a close reaches all of them.

    session = Session(workers={"gpu": Worker.at("127.0.0.1:7000")})
    part = session.open("net", graph, store=None)   # the graph's share: its runtime
    part.follow_math()                               # before the first call of a step
    part.call("gpu", fn, *args)                      # fn(live_graph, *args) over there
    part.add("body", pid)                            # which process ran "body"
    session.where()      # {"net": {"body": {pid: times}}}
    session.traffic(); session.close()

Each part is one graph on the workers, with its own session over there (its catalog, its
ordered calls): two GraphModules may both name a node ``body``. The worker processes
themselves are shared between the parts (and between fits, until nobody uses them).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

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


class Traffic(NamedTuple):
    """What a run moved to and from its workers, so far (a tuple: ``waited, sent,
    received = strategy.traffic()`` unpacks it).

        t = trainer.strategy.traffic()
        print(f"{t.waited:.2f} s waited, {t.sent} bytes sent, {t.received} received")
    """

    waited: float = 0.0  # seconds this process waited on workers
    sent: int = 0  # bytes sent to them
    received: int = 0  # bytes received from them


class Account:
    """Which process ran each node (or placed module) of each part, and how often, under
    one lock: a pipeline's stages are answered on other threads."""

    def __init__(self):
        self._ran: dict[str, dict[str, Counter]] = {}
        self._lock = threading.Lock()

    def open(self, part: str) -> None:
        """``part`` is answered by ``where()`` from now on, even before it runs."""
        with self._lock:
            self._ran.setdefault(part, {})

    def add(self, part: str, name: str, pid: int, times: int = 1) -> None:
        """``name`` of ``part`` ran ``times`` more in process ``pid``."""
        with self._lock:
            self._ran.setdefault(part, {}).setdefault(name, Counter())[pid] += times

    def count(self, part: str, pids: Mapping[Any, int], name_of=str) -> None:
        """Add one run per name of ``{what ran: pid}``, named by ``name_of(what)``: what
        several entries name (the positions a trainer stands in around its node) is one
        call, as the user counts it, in the process of the entry ``name_of`` ranks first
        (``name_of(what) -> name`` or ``(name, rank)``)."""
        calls: dict[str, tuple[Any, int]] = {}
        for n, pid in pids.items():
            got = name_of(n)
            name, rank = got if isinstance(got, tuple) else (got, 0)
            if name not in calls or rank < calls[name][0]:
                calls[name] = (rank, pid)
        with self._lock:
            ran = self._ran.setdefault(part, {})
            for name, (_, pid) in calls.items():
                ran.setdefault(name, Counter())[pid] += 1

    def where(self) -> dict[str, dict[str, dict[int, int]]]:
        """``{part: {name: {pid: times}}}``, a copy."""
        with self._lock:
            return {p: {n: dict(c) for n, c in ran.items()} for p, ran in self._ran.items()}


class Session:
    """The workers a run's placed work runs on, and what the run shares over them.

    Args:
        workers: ``{host: Worker}``; embedded ones (or torchrun's ranks) when not given.
        restart: what to do once a worker is lost, in the driver's words (a fit: "run the
            fit again"); the transport's own when not given.
    """

    def __init__(self, *, workers: Mapping[str, Any] | None = None,
                 restart: str | None = None):
        check_workers(workers)
        self.workers = dict(workers) if workers else None
        self.restart = restart
        self.account = Account()
        self.parts: dict[str, Part] = {}
        self._math_sent: list = []  # (runtime, the math settings call), answered or not
        self._done = [0.0, 0, 0]  # the traffic of parts closed already

    def open(self, name: str, graph: Graph, *, store: Any = None) -> Part:
        """The share of ``graph`` (its runtime, its keeper) under ``name``; a part of that
        name before it is closed first. ``graph`` should be the caller's own object: the
        runtime held for it is this part's alone."""
        old = self.parts.pop(name, None)
        if old is not None:
            old.close()
        part = self.parts[name] = Part(self, name, graph, store)
        self.account.open(name)
        return part

    def part(self, name: str) -> Part | None:
        """The open part called ``name``, or None."""
        got = self.parts.get(name)
        return None if got is None or got.closed else got

    def runtimes(self) -> list[Any]:
        """The runtimes of the open parts (one per graph that places work)."""
        return [p.runtime for p in self.parts.values() if p.runtime is not None]

    def follow_math(self, part: Part, hosts: Iterable[str] | None = None) -> None:
        """Send ``part``'s workers this process's math settings (threads, TF32,
        deterministic algorithms...) when they changed since: an ordered call of that
        part's session over there, so it runs before what the part sends after it. A Worker
        given its own threads keeps them."""
        runtime = part.runtime
        if runtime is None:
            return
        for host in part.hosts if hosts is None else hosts:
            flags = math_flags(threads=runtime.spec(host).threads is None)
            if part.math.get(host) != flags:
                part.math[host] = flags
                self._math_sent.append((runtime, runtime.call_async(host, set_math_live, flags)))
                for other in self.parts.values():  # one process serves a host's parts:
                    if other.math.get(host) != flags:  # one that sent other settings
                        other.math.pop(host, None)  # sends again, in its own order
        while self._math_sent and self._math_sent[0][1].done():
            runtime, sent = self._math_sent.pop(0)
            if not runtime.closed:  # a part closed or stopped since says so itself
                sent.result()  # raises what went wrong over there

    def where(self) -> dict[str, dict[str, dict[int, int]]]:
        """Which processes ran each node of each part: ``{part: {node: {pid: times}}}``."""
        return self.account.where()

    def traffic(self) -> Traffic:
        """Seconds this process waited on workers, bytes sent, bytes received, so far."""
        got = [self._done, *(part.traffic() for part in self.parts.values())]
        return Traffic(sum(g[0] for g in got), sum(g[1] for g in got), sum(g[2] for g in got))

    def abort(self, why: str) -> None:
        """Stop every part's workers now, waiting for nothing (Ctrl-C)."""
        for runtime in self.runtimes():
            runtime.abort(why)

    @property
    def closed(self) -> bool:
        """Whether every part's run over there is over."""
        return all(p.closed for p in self.parts.values())

    def close(self) -> None:
        """End every part's session over there, stopping the workers nobody else uses;
        idempotent. ``where()`` and ``traffic()`` stay readable."""
        for part in self.parts.values():
            part.close()


class Part:
    """One graph's share of a ``Session``: its runtime (a session of its own on each
    worker, over the graph's catalog), its keeper, and its calls."""

    def __init__(self, session: Session, name: str, graph: Graph, store: Any = None):
        self.session, self.name, self.graph = session, name, graph
        self.keeper = _holes.keeper(store)
        self.math: dict[str, tuple] = {}  # per host: the math settings as last sent
        self.runtime: Any = None
        if graph.placement.hosts:
            self.runtime = _holes.transport().runtime_for(graph, session.workers)
            if session.restart is not None:
                self.runtime.restart = session.restart
            self.runtime.provision(graph)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts this part's graph places work on."""
        return tuple(self.graph.placement.workers())

    def follow_math(self, hosts: Iterable[str] | None = None) -> None:
        """The session's ``follow_math`` for this part (every host of it by default)."""
        self.session.follow_math(self, hosts)

    def send(self, host: str, fn: Any, *args: Any) -> None:
        """Run ``fn(live_graph, *args)`` on ``host``'s worker before what this part sends
        after it, not waited for: what went wrong there is raised at a later send or
        ``follow_math``."""
        runtime = self._open(host)
        self.session._math_sent.append((runtime, runtime.call_async(host, fn, *args)))

    def add(self, name: str, pid: int) -> None:
        """``name`` (a node, a placed module) of this part ran once more in ``pid``."""
        self.session.account.add(self.name, name, pid)

    def count(self, pids: Mapping[Any, int], name_of=str) -> None:
        """One run more per entry of ``{what ran: pid}``, named by ``name_of(what)``."""
        self.session.account.count(self.name, pids, name_of)

    def call(self, host: str, fn: Any, *args: Any) -> Any:
        """Run ``fn(live_graph, *args)`` on ``host``'s worker; return what it returns."""
        runtime = self._open(host)
        return runtime.call(host, fn, *args)

    def call_async(self, host: str, fn: Any, *args: Any) -> Any:
        """``call`` without waiting: ``.result()`` answers."""
        runtime = self._open(host)
        return runtime.call_async(host, fn, *args)

    def _open(self, host: str) -> Any:
        if self.runtime is None:
            what = "places nothing" if not self.graph.placement.hosts else "is closed"
            raise WorkerError(f"worker {host!r}: the run of part {self.name!r} over there "
                              f"{what}; run again (a new fit, graph or trainer) to start anew")
        return self.runtime

    def where(self) -> dict[str, dict[int, int]]:
        """Which processes ran each node of this part: ``{node: {pid: times}}``."""
        return self.session.where().get(self.name, {})

    def traffic(self) -> Traffic:
        """Seconds waited on this part's workers, bytes sent, bytes received, so far."""
        runtime = self.runtime
        if runtime is None:
            return Traffic()
        return Traffic(runtime.waited, runtime.sent, runtime.received)

    @property
    def closed(self) -> bool:
        """Whether the run over there is over (closed, or stopped by Ctrl-C)."""
        return self.runtime is None or getattr(self.runtime, "closed", False)

    def close(self) -> None:
        """End this graph's session over there, stopping the workers nobody else uses
        (idempotent)."""
        if self.runtime is not None:
            done = self.session._done
            for i, v in enumerate(self.traffic()):
                done[i] += v  # the session's traffic still counts it
            self.runtime = None
            _holes.transport().release(self.graph)
