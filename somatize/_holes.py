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

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class Runtime(Protocol):
    """What the engine asks of a transport's runtime (``somatize.remote.Runtime`` is one)."""

    def submit(self, stretch: Any) -> Any:
        """Send a stretch away; ``.result()`` answers its Outcome."""

    def keeps(self) -> bool:
        """Whether any worker of the run keeps what it runs."""


class Transport(NamedTuple):
    """How placed nodes reach their workers: the runtime a graph runs on, its end, and
    tracing over there (start: runtime -> clock offsets; collect: runtime, offsets ->
    the workers' spans on this clock)."""

    runtime_for: Callable[[Any, Any], Runtime]  # (graph, workers) -> the graph's runtime
    release: Callable[[Any], None]  # (graph) -> stop the workers it started
    trace_start: Callable[[Any], dict] | None = None
    trace_collect: Callable[..., list] | None = None


_filled: dict[str, Any] = {"keeper": None, "transport": None, "mapped": None}
_adapters: list[Callable[[Any], Any]] = []


def fill(**holes: Any) -> None:
    """Fill holes by name: ``keeper=`` (opens ``store=``), ``transport=`` (a Transport),
    ``mapped=`` (answers a ``.mapped()`` node's batch item by item)."""
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


def transport() -> Transport:
    """The transport placed nodes travel by."""
    t = _filled["transport"]
    if t is None:
        from ._errors import WorkerError

        raise WorkerError("no transport is registered: import somatize.remote to run "
                          "placed nodes")
    return t
