"""A runtime: the workers one Graph (or Trainer) runs on, with its own session on each.

    rt = runtime_for(g, {"gpu": Worker.at("127.0.0.1:7000")})
    rt.provision(g)                      # each worker its own nodes, and the graph's ids
    rt.submit(stretch).result()          # an Outcome; what cannot travel is Left
    rt.call("gpu", lambda live: live["body"].lin.weight.clone())
    rt.close()
"""

from __future__ import annotations

import logging
import re
import threading
import time
import types
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

from .. import _errors
from .._errors import SomatizeError, WorkerError
from .._node import kind_of
from .._trace import span
from ._group import group
from ._peer import Peer
from ._serve import Failed
from ._wire import bytes_of, graph_for
from ._worker import Worker

log = logging.getLogger(__name__)


class Runtime:
    """The workers a graph's placed nodes run on; ``close()`` stops what it started."""

    def __init__(self, graph, workers: Mapping[str, Any] | None = None):
        self._graph = weakref.ref(graph)  # whoever runs the graph holds it, not its runtime
        self.hosts = graph.placement.workers()
        self.workers = dict(workers or {})
        self.session = uuid.uuid4().hex[:12]
        self.peers: dict[str, Peer] = {}
        self.timeout: dict[str, float] = {}  # per host, as this run's Worker says
        self.provisioned: set[str] = set()
        self.closed = False
        # what crossed and how long this process waited on workers (somatize/* metrics)
        self.sent = self.received = 0
        self.waited = 0.0
        self.ended = "it was closed"  # why it is closed, once it is
        # what to do once a worker is lost (a route with no graph to close says its own)
        self.restart = "close the graph or trainer (.close()) and run again, which starts a " \
            "fresh worker"
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # a ticket is numbered and sent in one go
        self._tickets: dict[str, int] = {}  # per host: the next ordered call's number
        self._flying: dict[int, tuple[Peer, Any]] = {}  # calls sent, not yet read
        group().runtimes.add(self)

    # -- workers ------------------------------------------------------------------
    def spec(self, host: str) -> Worker:
        """How ``host``'s worker is had: as given, else torchrun's rank, else embedded."""
        w = self.workers.get(host)
        if isinstance(w, str):
            return Worker.at(w)
        if isinstance(w, Worker):
            return w
        if w is not None:
            raise WorkerError(f"workers[{host!r}] is a {type(w).__name__}: give a Worker, "
                              "e.g. Worker.at('127.0.0.1:7000'), or leave it out")
        ranks = group().static
        if ranks is not None:
            # by default the graph's hosts are ranks 1, 2, ... in first-use order
            return Worker.rank(ranks.get(host) or self.hosts.index(host) + 1)
        return Worker.embedded()

    def start(self, hosts=None) -> list[Peer]:
        """Start (or reuse) the workers of ``hosts`` (default: every host the graph uses)."""
        if self.closed:
            raise WorkerError(f"this run is over ({self.ended}): run the graph again (a new "
                              "Trainer) to start a new one")
        with self._lock:
            hosts = list(hosts if hosts is not None else self.hosts)
            fresh = [h for h in hosts if h not in self.peers]
            specs = {h: self.spec(h) for h in fresh}
            group().start(list(specs.values()))  # they say whether the run can be isolated
            for h in fresh:
                spec = specs[h]
                self.peers[h], self.timeout[h] = group().peer(h, spec), spec.timeout
            group().wait_joined([self.peers[h] for h in fresh])
            for h in fresh:
                p = self.peers[h]
                info = self._rpc(p, "greeting it", _serve_fn("hello"), ())
                p.keeps, p.pid = info["keeps"], info["pid"]
                p.device = info.get("device", "cpu")
            return [self.peers[h] for h in hosts]

    def keeps(self) -> bool:
        """Whether any worker of the run keeps what it runs (then values are named)."""
        return any(p.keeps for p in self.start())

    # -- what travels -------------------------------------------------------------
    @property
    def graph(self):
        """The graph this runtime provisions (None once nobody holds it)."""
        return self._graph()

    def provision(self, graph=None) -> None:
        """Send each worker the nodes placed on it and the graph's identity (ids, kinds,
        edges, placement, memory); refused over a different catalog, and before anything
        starts for a placed node that does not pickle."""
        if graph is not None and graph is not self.graph:
            self._graph, self.provisioned = weakref.ref(graph), set()
            self.hosts = tuple(dict.fromkeys([*self.hosts, *graph.placement.workers()]))
        graph = self.graph
        catalog = {n: kind_of(o) for n, o in graph.catalog.items()}
        blobs = {h: graph_for(graph, h) for h in self.hosts}
        peers = self.start()
        what = "provisioning the graph"
        futs = [(p, self._async(p, _serve_fn("provision"),
                                (self.session, *blobs[p.host], catalog), what))
                for p in peers]
        for p, f in futs:
            self._answer(p, what, f)
            self.provisioned.add(p.host)

    def submit(self, stretch) -> _Pending:
        """Send a stretch to its worker; ``.result()`` is its Outcome."""
        if self.closed:
            raise self._ended(stretch.host)
        if stretch.host not in self.provisioned:
            self.provision()
        p = self.peers[stretch.host]
        what = f"running {', '.join(map(str, stretch.nodes))}"
        return _Pending(self, p, what,
                        self._async(p, _serve_fn("run"), (self.session, stretch), what,
                                    ordered=True))

    def call(self, host: str, fn, *args: Any, **kw: Any) -> Any:
        """Run ``fn(live_graph, *args, **kw)`` on ``host``'s worker and return its result."""
        if self.closed:
            raise self._ended(host)
        if host not in self.provisioned:
            self.provision()
        if host not in self.peers:
            raise WorkerError(f"no worker {host!r} in this run: the graph places nodes on "
                              f"{list(self.peers)}")
        p = self.peers[host]
        name = getattr(fn, "__qualname__", type(fn).__name__)
        what = f"calling {name}"
        return self._answer(p, what, self._async(p, _serve_fn("call"),
                                                 (self.session, _code(fn), args, kw), what,
                                                 ordered=True))

    def call_async(self, host: str, fn, *args: Any) -> _Pending:
        """``call`` without waiting: ``.result()`` answers (or raises WorkerError)."""
        if self.closed:
            raise self._ended(host)
        if host not in self.provisioned:
            self.provision()
        p = self.peers[host]
        what = f"calling {getattr(fn, '__qualname__', type(fn).__name__)}"
        return _Pending(self, p, what, self._async(
            p, _serve_fn("call"), (self.session, _code(fn), args, {}), what, ordered=True))

    def close(self) -> None:
        """Close this run's sessions and stop the workers nobody else uses (idempotent).

        Nothing in flight is waited for: a worker still busy with this run's call (an
        exception or Ctrl-C here left it) is stopped at once when no other run uses it."""
        if self.closed:
            return
        self.closed = True
        import torch.distributed.rpc as rpc

        busy = {p.host for p, f in self._flying.values() if not f.done()}
        self._flying.clear()
        for p in self.peers.values():
            if (p.host in busy or p.unanswered) and p.users <= 1:
                group().kill(p, "it was stopped in the middle of a call, when its run closed")
                continue
            if p.unanswered:  # shared with another run: leave it to that one
                group().release(p)
                continue
            if p.why_dead() is None and group().started:
                try:
                    rpc.rpc_sync(p.name, _serve_fn("close"), args=(self.session,),
                                 timeout=min(p.timeout, 10.0))
                except Exception as e:
                    log.warning("worker %r: closing session: %s", p.host, e)
            group().release(p)
        self.peers.clear()

    def abort(self, why: str) -> None:
        """Stop this run's workers now, waiting for nothing (Ctrl-C): embedded processes
        are killed, standing ones' runs ended by their daemons (idempotent)."""
        if self.closed:
            return
        self.closed, self.ended = True, why
        self._flying.clear()
        for p in self.peers.values():
            group().kill(p, why)
        self.peers.clear()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls --------------------------------------------------------------------
    def _async(self, p: Peer, fn, args: tuple, what: str, ordered: bool = False):
        """Send ``fn(*args)`` to ``p``. ``ordered``: a run's stretch or call, numbered so
        that the worker runs this session's calls in the order they were sent."""
        import torch.distributed.rpc as rpc

        if p.why_dead() is not None:
            raise self._lost(p, what)
        sent = bytes_of(args)
        self.sent += sent
        try:
            with self._sending, span(f"send to {p.host}: {what}", "transfer", bytes=sent):
                if ordered:
                    args = (*args, self._tickets.get(p.host, 0))
                fut = rpc.rpc_async(p.name, fn, args=args, timeout=self.timeout[p.host])
                if ordered:  # numbered once sent: one that never left leaves no gap
                    self._tickets[p.host] = args[-1] + 1
        except Exception as e:  # raised at once: the agent no longer knows the worker
            raise self._failure(p, what, e) from None
        if len(self._flying) > 64:  # calls nobody read (a walk that raised): forget the done
            self._flying = {k: pf for k, pf in self._flying.items() if not pf[1].done()}
        self._flying[id(fut)] = (p, fut)
        return fut

    def _rpc(self, p: Peer, what: str, fn, args: tuple) -> Any:
        return self._answer(p, what, self._async(p, fn, args, what))

    def _answer(self, p: Peer, what: str, fut) -> Any:
        try:
            t = time.monotonic()
            with span(f"wait for {p.host}: {what}", "wait") as said:
                got = _wait(fut)
                said["bytes"] = received = bytes_of(got)
            self.waited += time.monotonic() - t
            self.received += received
        except KeyboardInterrupt:
            self.abort("it was stopped when this process was interrupted (Ctrl-C)")
            raise
        except Exception as e:
            raise self._failure(p, what, e) from None
        finally:
            self._flying.pop(id(fut), None)
        if isinstance(got, Failed):
            raise _raised_over_there(p, what, got)
        return got

    def _ended(self, host: str) -> WorkerError:
        return WorkerError(f"worker {host!r}: this run is over ({self.ended}); its state over "
                           "there is gone. Run the graph again (a new Trainer) to start anew")

    def _lost(self, p: Peer, what: str) -> WorkerError:
        return WorkerError(
            f"worker {p.host!r} ({p.kind}, pid {p.pid}) was lost before {what}: {p.dead}. "
            f"Its state over there is gone; {self.restart}"
        )

    def _failure(self, p: Peer, what: str, e: Exception) -> WorkerError:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if msg.split(": ", 1)[-1].startswith("On WorkerInfo(") and p.why_dead() is None:
            return self._unreadable(p, what, str(e))
        dead = p.why_dead()
        if dead is None and ("timed out" in msg.lower() or "timeout" in msg.lower()):
            p.unanswered = True  # closing waits for it no longer: it is stopped at once
            return WorkerError(
                f"worker {p.host!r} did not answer within {self.timeout[p.host]:g} s while {what}: "
                "its machine may be unreachable, or the call slower than that: raise its "
                f"timeout (Worker(timeout=...)) if that is expected ({msg})"
            )
        if dead is None:  # a process killed (out of memory?) is reaped just after its pipes close
            dead = p.dead = p.why_dead(grace=2.0) or f"it is unreachable ({msg})"
        group().forget(p)
        return WorkerError(
            f"worker {p.host!r} ({p.kind}, pid {p.pid}) was lost while {what}: {dead}. "
            f"Its state over there is gone; {self.restart}"
        )

    def _unreadable(self, p: Peer, what: str, said: str) -> WorkerError:
        # the worker raised before any of ours ran: it could not unpickle the call. Its
        # number never came to its turn, so this run's calls over there are out of step:
        # nothing more is sent to it
        lines = said.strip().splitlines()
        cause = lines[1] if len(lines) > 1 else lines[0]
        raised = re.match(r"(\w+)\([\"'](.*?)(?: Default RPC pickler.*)?[\"']?\)?$", cause)
        if raised:  # AttributeError("Can't get ...") -> AttributeError: Can't get ...
            cause = f"{raised[1]}: {raised[2]}"
        p.dead = f"it could not read the arguments of a call ({cause})"
        group().forget(p)
        return WorkerError(
            f"worker {p.host!r} could not read the arguments of {what}: {cause}. A class "
            "(or function) that an argument uses and that your script defines in __main__ "
            "cannot be rebuilt over there: move it to a module both sides import. This run "
            "is over on that worker; run again once fixed")


class _Pending:
    """A stretch in flight; ``result()`` waits for its Outcome (or raises WorkerError)."""

    def __init__(self, rt: Runtime, peer: Peer, what: str, fut):
        self.rt, self.peer, self.what, self.fut = rt, peer, what, fut

    def result(self):
        return self.rt._answer(self.peer, self.what, self.fut)

    def done(self) -> bool:
        return self.fut.done()


def _wait(fut) -> Any:
    """``fut.wait()``, in slices the main thread can be interrupted between (Ctrl-C):
    a bare wait blocks in C until the call answers or times out."""
    if not fut.done():
        # a bare lock, not an Event: its acquire is one C call, and a signal ends it too
        answered = threading.Lock()
        answered.acquire()
        fut.add_done_callback(lambda _: answered.release())
        while not answered.acquire(timeout=0.2):
            pass
    return fut.wait()


def _raised_over_there(p: Peer, what: str, f: Failed) -> BaseException:
    at = f"node {f.node!r}" if f.node else what
    if f.raised is not None:  # a node's or a call's own: its type, the trace its cause
        from ..torch._raised import rebuilt

        where = f"worker {p.host!r} (pid {p.pid})"
        return rebuilt(f.raised, f"node {f.node!r} on {where}" if f.node
                       else f"{where}, {what}")
    trace = f"\n--- traceback on worker {p.host!r} (pid {p.pid}) ---\n{f.trace}" if f.trace else ""
    cls = getattr(_errors, f.error, None)
    if isinstance(cls, type) and issubclass(cls, SomatizeError) and cls is not WorkerError:
        return cls(f"on worker {p.host!r}: {f.message}{trace}")
    return WorkerError(
        f"{at} raised {f.error} on worker {p.host!r}: {f.message}{trace}"
    )


_codes: dict[Any, bytes] = {}


def _code(fn) -> bytes:
    """``fn`` pickled for a call; a module's own function (by reference, the same bytes
    each time) only once."""
    plain = isinstance(fn, types.FunctionType) and fn.__module__ != "__main__" \
        and "<locals>" not in fn.__qualname__
    if plain and fn in _codes:
        return _codes[fn]
    from ..torch._pickling import dumps  # (torch is loaded where a call is made)

    code = dumps(fn)
    if plain:
        _codes[fn] = code
    return code


def _serve_fn(name: str):
    from . import _serve

    return getattr(_serve, name)


# the runtime each graph runs on, held here (a Graph is facts only): a second forward
# reuses its workers; the graph's close() ends them (interpreter exit at the latest)
_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runtime_for(graph, workers: Mapping[str, Any] | None = None) -> Runtime:
    """The runtime of ``graph`` (held for it, so a second forward reuses its workers)."""
    _errors.check_workers(workers)
    rt = _held.get(graph)
    if rt is not None and not rt.closed and (not workers or dict(workers) == rt.workers):
        return rt
    if rt is not None:
        rt.close()
    unknown = set(workers or {}) - set(graph.placement.workers())
    if unknown:
        log.info("workers %s are given but the graph places no node on them", sorted(unknown))
    rt = Runtime(graph, workers)
    _held[graph] = rt
    return rt


def release(graph) -> None:
    """Close the runtime ``graph`` runs on, stopping the workers nobody else uses."""
    rt = _held.pop(graph, None)
    if rt is not None:
        rt.close()
