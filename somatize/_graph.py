"""The graph: what exists (nodes, edges), who executes it (the catalog), where
(placement) and what is remembered (memory) — inert facts read off a composition.
Running and drawing are functions over these facts (``_engine``, ``_describe``); the
methods that do them here only call those.

    g = Graph.somatize(Body().at("gpu") >> Head())
    g.ids, g.edges, g.placement.get("body"), g.plan.waves
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import _describe, _engine
from ._errors import GraphError
from ._node import Expr, Node, Par, Seq, as_expr, kind_of
from ._plan import plan


@dataclass(frozen=True)
class Placement:
    """Where each node runs: node id -> host name; a node not listed runs here."""

    hosts: Mapping[str, str] = field(default_factory=dict)

    def get(self, node: str) -> str | None:
        return self.hosts.get(node)

    def workers(self) -> tuple[str, ...]:
        """The host names the graph needs, in first-use order."""
        return tuple(dict.fromkeys(self.hosts.values()))


@dataclass(frozen=True)
class Memory:
    """What is remembered: nodes declared frozen, cached ones with their salt, and the
    cached ones kept item by item (``.mapped()``)."""

    frozen: frozenset[str] = frozenset()
    cached: Mapping[str, str | None] = field(default_factory=dict)
    mapped: frozenset[str] = frozenset()


class Graph:
    """A graph of nodes; build one with ``Graph.somatize(expr)``."""

    def __init__(
        self,
        catalog: Mapping[str, Any],
        edges: Iterable[tuple[str, str]],
        placement: Placement | None = None,
        memory: Memory | None = None,
        reports: Mapping[str, str] | None = None,
    ):
        self.catalog: Mapping[str, Any] = MappingProxyType(dict(catalog))
        # the id a node's ctx reports, where it is not its own (a trained node's position)
        self.reports: dict[str, str] = dict(reports or {})
        self.edges: tuple[tuple[str, str], ...] = tuple(dict.fromkeys(edges))
        self.placement = placement or Placement()
        self.memory = memory or Memory()
        preds: dict[str, list[str]] = {n: [] for n in self.catalog}
        for p, c in self.edges:
            preds[c].append(p)
        self.preds: Mapping[str, tuple[str, ...]] = MappingProxyType(
            {n: tuple(ps) for n, ps in preds.items()}
        )
        self.plan = plan(self)

    # -- building ---------------------------------------------------------------
    @classmethod
    def somatize(cls, expr: Node | Expr | Any) -> Graph:
        """Build the graph of a composition (a lone node is a graph too)."""
        expr = as_expr(expr)
        leaves: list[Any] = []
        _collect(expr, leaves, set())
        ids = _assign_ids(leaves)
        edges: list[tuple[str, str]] = []
        _wire(expr, ids, edges)
        catalog = {ids[id(n)]: n for n in leaves}
        hosts = {i: n._soma_host for i, n in catalog.items() if n._soma_host is not None}
        memory = Memory(
            frozen=frozenset(i for i, n in catalog.items() if n._soma_frozen),
            cached={i: n._soma_salt for i, n in catalog.items() if n._soma_cached},
            mapped=frozenset(i for i, n in catalog.items() if n._soma_mapped),
        )
        for i in sorted(memory.mapped - set(memory.cached)):
            raise GraphError(f"node {i!r} is .mapped() but not .cached(): .mapped() says how "
                             f"its output is kept (item by item). Declare it "
                             f"{kind_of(catalog[i])}(...).frozen().cached().mapped()")
        return cls(catalog, edges, Placement(hosts), memory)

    # -- reading ----------------------------------------------------------------
    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self.catalog)

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(n for n in self.catalog if not self.preds[n])

    @property
    def sinks(self) -> tuple[str, ...]:
        fed = {p for p, _ in self.edges}
        return tuple(n for n in self.catalog if n not in fed)

    def successors(self, node: str) -> tuple[str, ...]:
        return tuple(c for p, c in self.edges if p == node)

    def ancestors(self, node: str) -> set[str]:
        """Every node upstream of ``node`` (not itself)."""
        seen: set[str] = set()
        todo = list(self.preds[node])
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo.extend(self.preds[p])
        return seen

    def __getitem__(self, node: str) -> Any:
        try:
            return self.catalog[node]
        except KeyError:
            raise GraphError(
                f"no node {node!r} in this graph; its nodes are {list(self.catalog)}"
            ) from None

    def __repr__(self) -> str:
        return f"Graph({' '.join(f'{p}->{c}' for p, c in self.edges) or ', '.join(self.ids)})"

    def replace(self, *, catalog: Mapping[str, Any], edges: Iterable[tuple[str, str]],
                hosts: Mapping[str, str], reports: Mapping[str, str] | None = None) -> Graph:
        """A graph with these nodes, edges and hosts, remembering what this one does (how
        a training run's graph is read off the user's: ``_learning.around``)."""
        return Graph(catalog, edges, Placement(hosts), self.memory, reports)

    # -- what is done with it: functions elsewhere, called from here ----------------
    def forward(self, input: Any = None, store: Any = None, workers: Any = None, *,
                feeds: Mapping[str, Any] | None = None, training: bool = False) -> Any:
        """Run the graph and return the sink's bare value (``{sink: value}`` for several).

        Args:
            input: what every root is fed (bare or ``Opaque``).
            store: a directory path or a Keeper; cached nodes are looked up and kept there.
            workers: ``{host: Worker}`` for placed nodes; placed nodes with no worker
                given run on local worker processes started (once) for this graph.
            feeds: ``{root_id: value}`` to feed roots different inputs.
            training: what ``ctx.training`` says to the nodes.
        """
        return _engine.run_graph(self, input, store=store, workers=workers, feeds=feeds,
                                 training=training)

    def provision(self, workers: Any = None) -> None:
        """Send each worker the nodes placed on it and the graph's identity (ids, edges,
        placement), starting local workers if needed."""
        _engine.provision(self, workers)

    def close(self) -> None:
        """Stop the worker processes this graph's runs started (idempotent)."""
        _engine.close(self)

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self, trained: Iterable[str] = ()) -> str:
        """The graph as text: each node with its id, host, stage and memory marks."""
        return _describe.describe(self, trained)

    def dot(self, trained: Iterable[str] = ()) -> str:
        """The graph as Graphviz DOT, one cluster per stage."""
        return _describe.dot(self, trained)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["catalog"] = dict(self.catalog)
        state["preds"] = dict(self.preds)
        return state

    def __setstate__(self, state):
        state["catalog"] = MappingProxyType(state["catalog"])
        state["preds"] = MappingProxyType(state["preds"])
        self.__dict__.update(state)


def _collect(expr: Any, leaves: list, seen: set[int]) -> None:
    # by hand, not by recursion: a composition nested thousands deep is legitimate
    todo = [expr]
    while todo:
        e = todo.pop()
        if isinstance(e, (Seq, Par)):
            todo.extend(reversed(e.items))
        elif id(e) not in seen:  # the same node object twice is one node
            seen.add(id(e))
            leaves.append(e)


_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def _assign_ids(leaves: list) -> dict[int, str]:
    ids: dict[int, str] = {}
    taken: dict[str, Any] = {}
    for n in leaves:
        name = n._soma_name
        if name is None:
            continue
        if not isinstance(name, str) or not _ID.match(name) or ":" in name:
            raise GraphError(
                f"{kind_of(n)}.named({name!r}): an id is letters, digits, '_', '-' or '.', "
                "starting with a letter or '_'"
            )
        if name in taken:
            raise GraphError(
                f"two nodes are named {name!r} ({kind_of(taken[name])} and {kind_of(n)}): "
                "ids must be unique; rename one with .named('...')"
            )
        taken[name] = n
        ids[id(n)] = name
    counts: dict[str, int] = {}
    for n in leaves:
        if id(n) in ids:
            continue
        base = kind_of(n).lower()
        k = counts.get(base, 0)
        while True:
            k += 1
            name = base if k == 1 else f"{base}_{k}"
            if name not in taken:
                break
        counts[base] = k
        taken[name] = n
        ids[id(n)] = name
    return ids


def _wire(expr: Any, ids: dict[int, str], edges: list) -> tuple[list[str], list[str]]:
    """Add the edges of ``expr``; return its (sources, sinks). Walked by hand (post-order),
    not by recursion, so that depth is no limit."""
    done: dict[int, tuple[list[str], list[str]]] = {}
    todo: list[tuple[Any, bool]] = [(expr, False)]
    while todo:
        e, ready = todo.pop()
        if id(e) in done and not isinstance(e, (Seq, Par)):
            continue
        if not isinstance(e, (Seq, Par)):
            done[id(e)] = ([ids[id(e)]], [ids[id(e)]])
        elif not ready:
            todo.append((e, True))
            todo.extend((i, False) for i in reversed(e.items))
        elif isinstance(e, Seq):
            sources, sinks = done[id(e.items[0])]
            for item in e.items[1:]:
                s, t = done[id(item)]
                edges.extend((p, c) for p in sinks for c in s)
                sinks = t
            done[id(e)] = (sources, sinks)
        else:
            sources, sinks = [], []
            for item in e.items:
                s, t = done[id(item)]
                sources += [x for x in s if x not in sources]
                sinks += [x for x in t if x not in sinks]
            done[id(e)] = (sources, sinks)
    return done[id(expr)]
