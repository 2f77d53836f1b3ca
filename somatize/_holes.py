"""The holes the core leaves for the layers above it, and what fills them.

The core (graph, plan, stages, keys, the engine) never imports the store, the
transport or the torch adapters: they register here when they are imported, and
``somatize/__init__.py`` wires lazy defaults (each imports its layer at first use).

    fill(keeper=open_keeper)                   # somatize.store
    fill(transport=Transport(runtime_for, release))   # somatize.remote
    adapt(lambda obj: node(obj) if isinstance(obj, nn.Module) else None)

    keeper = holes.keeper(store)               # what the engine asks
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol


class Pending(Protocol):
    """A call in flight."""

    def result(self) -> Any:
        """Wait for the answer and return it; a worker's failure is raised here, as a
        ``WorkerError`` naming the worker (or the node's own error type)."""

    def done(self) -> bool:
        """Whether the answer is here (``result()`` would not wait)."""


class Spec(Protocol):
    """How a host's worker is had (``somatize.remote.Worker`` is one)."""

    threads: int | None  # math threads set over there (None: as many as here)


class Peer(Protocol):
    """A worker process of a run, as the layers above read it."""

    device: str  # where placed modules compute over there ("cpu", "cuda:0")
    pid: int | None  # its process (None until it has answered)


class Runtime(Protocol):
    """A run's workers: every call the layers above make on a transport's runtime
    (``somatize.remote.Runtime`` is one; tests/test_remote.py checks it against this).

    A call to a host not yet provisioned provisions the run first; a call after
    ``close()`` raises ``WorkerError`` saying the run is over.
    """

    peers: Mapping[str, Peer]  # host -> its worker, once started
    closed: bool  # True once close() ran (or Ctrl-C stopped the run)
    restart: str  # what to do once a worker is lost (the route that runs says: a fit or a graph)
    sent: int  # bytes sent to the workers so far
    received: int  # bytes received from them so far
    waited: float  # seconds this process waited on them so far

    def submit(self, stretch: Any) -> Pending:
        """Send a stretch (``_engine.Stretch``) to its host; ``.result()`` answers its
        ``_engine.Outcome``, with what cannot travel left there as ``Left``."""

    def keeps(self) -> bool:
        """Whether any worker of the run keeps what it runs (then values are named)."""

    def provision(self, graph: Any = None) -> None:
        """Send each worker the nodes of ``graph`` (default: the run's own) placed on it,
        and the graph's identity; refused over a different catalog."""

    def call(self, host: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run ``fn(live, *args, **kw)`` on ``host``'s worker, in order after what was sent
        to it before, and return its result (``live``: the worker's nodes by id)."""

    def call_async(self, host: str, fn: Callable[..., Any], *args: Any) -> Pending:
        """``call`` without waiting for the answer."""

    def spec(self, host: str) -> Spec:
        """How ``host``'s worker is had (as given, torchrun's rank, or embedded)."""

    def close(self) -> None:
        """End the run: close its sessions and stop the workers nobody else uses
        (idempotent)."""

    def abort(self, why: str) -> None:
        """Stop the run's workers now, waiting for none (Ctrl-C): embedded ones are
        killed, standing ones' runs ended, each told ``why`` (idempotent)."""


class Transport(NamedTuple):
    """How placed nodes reach their workers: the runtime a graph runs on, its end, and
    tracing over there (start: runtime -> clock offsets; collect: runtime, offsets ->
    the workers' spans on this clock)."""

    runtime_for: Callable[[Any, Any], Runtime]  # (graph, workers) -> the graph's runtime
    release: Callable[[Any], None]  # (graph) -> stop the workers it started
    trace_start: Callable[[Runtime], dict] | None = None
    trace_collect: Callable[..., list] | None = None  # (runtime, offsets, end=False)


_filled: dict[str, Any] = {"keeper": None, "transport": None, "mapped": None,
                           "computed": None}
_adapters: list[Callable[[Any], Any]] = []


def fill(**holes: Any) -> None:
    """Fill holes by name: ``keeper=`` (opens ``store=``), ``transport=`` (a Transport),
    ``mapped=`` (answers a ``.mapped()`` node's batch item by item), ``computed=``
    (computes a cached node's miss)."""
    unknown = set(holes) - set(_filled)
    if unknown:
        raise KeyError(f"no hole {sorted(unknown)}; the holes are {sorted(_filled)}")
    _filled.update(holes)


def adapt(adapter: Callable[[Any], Any]) -> None:
    """Register ``adapter(obj) -> node or None``: how a foreign object becomes a node."""
    if adapter not in _adapters:
        _adapters.append(adapter)


def adapted(obj: Any) -> Any:
    """``obj`` as a node by the first adapter that takes it, else None."""
    for a in _adapters:
        got = a(obj)
        if got is not None:
            return got
    return None


def keeper(store: Any) -> Any:
    """What ``store=`` names, opened (None for no store)."""
    if store is None:
        return None
    opener = _filled["keeper"]
    if opener is None:
        from ._errors import StoreError

        raise StoreError("no keeper is registered: import somatize.store to open store=")
    return opener(store)


def mapped() -> Callable[..., Any]:
    """What answers a ``.mapped()`` node's batch item by item: ``(graph, node id, node,
    input, keeper, run) -> value``, ``run(sub-batch)`` running the node."""
    m = _filled["mapped"]
    if m is None:
        from ._errors import StoreError

        raise StoreError("nothing answers .mapped() nodes: import somatize.torch")
    return m


def computed(graph, n: str, node: Any, run: Callable[[], Any]) -> Any:
    """A cached node's value computed for a miss: ``run()``, checked by what fills the
    ``computed`` hole (somatize.torch refuses a forward that draws random numbers)."""
    c = _filled["computed"]
    return run() if c is None else c(graph, n, node, run)


def transport() -> Transport:
    """The transport placed nodes travel by."""
    t = _filled["transport"]
    if t is None:
        from ._errors import WorkerError

        raise WorkerError("no transport is registered: import somatize.remote to run "
                          "placed nodes")
    return t
