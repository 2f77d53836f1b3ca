"""The engine: walks a graph (or a stretch of it) wave by wave, here, handing remote
stretches to the transport, with each value's key travelling beside it.

    outcome = walk(graph, graph.plan.order, inputs={"body": x})
    outcome.values["head"], outcome.keys["head"]
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import _holes
from ._errors import ContractError, Lost, MissingInput, check_workers
from ._learning import Learning
from ._memory import cacheable, check_settled
from ._naming import cached_here, keep, look_up, naming
from ._node import Ctx, kind_of
from ._plan import Unit, units
from ._trace import span
from ._values import Done, FanIn, Left, bare


@dataclass
class Outcome:
    """What a walk produced: values by node (``Left`` for what stayed behind), and keys."""

    values: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str | None] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    hits: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)  # node -> the process that ran it


@dataclass(frozen=True)
class Stretch:
    """A stretch of consecutive nodes sent to one worker, with what it is handed."""

    host: str
    nodes: tuple[str, ...]
    given: Mapping[str, Any]
    given_keys: Mapping[str, str | None]
    inputs: Mapping[str, Any]
    naming: bool
    training: bool
    wanted: tuple[str, ...]


def run_node(node_id: str, node: Any, x: Any, host: str | None, training: bool) -> Any:
    """Call one node's forward with its bare input; return what its ``Done`` holds."""
    out = node.forward(bare(x), Ctx(node_id, host, training))
    if not isinstance(out, Done):
        raise ContractError(
            f"node {node_id!r} ({kind_of(node)}).forward returned {type(out).__name__}, "
            f"not Done: end its forward with `return Done(value)`"
        )
    return out.value


def walk(
    graph,
    order: Iterable[str],
    *,
    inputs: Mapping[str, Any] | None = None,
    given: Mapping[str, Any] | None = None,
    given_keys: Mapping[str, str | None] | None = None,
    here: str | None = None,
    keeper: Any = None,
    naming: bool = False,
    training: bool = False,
    remote: _holes.Runtime | None = None,
    wanted: Iterable[str] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> Outcome:
    """Run the nodes of ``order`` (topological) of ``graph``, on ``here``'s side.

    Args:
        inputs: what each root among them is fed.
        given: values produced outside this walk, by producer id.
        given_keys: their keys, when naming.
        keeper: where cached nodes run here are looked up and kept.
        naming: compute keys (a keeper is present here or on some worker).
        remote: the transport that runs stretches on other hosts.
        wanted: the nodes whose values the caller needs (default: all).
        meanwhile: called once, after the first wave's stretches are sent and before
            anything runs here (the caller's own work, done while the far side computes).
    """
    order = tuple(order)
    inputs = inputs or {}
    given = dict(given or {})
    preds = graph.preds
    out = Outcome()
    values = out.values
    keys = out.keys
    hits: dict[str, Any] = {}
    if naming:
        named = look_up(graph, order, inputs=inputs, given_keys=given_keys, here=here,
                        keeper=keeper)
        keys.update(named.keys)
        hits = named.hits
    shape = _shape_of(graph, order, here, wanted, hits)
    cached = shape.cached
    mapped = graph.memory.mapped
    pid = os.getpid()

    def read(consumer: str, p: str) -> Any:
        v = values[p] if p in values else given[p] if p in given else _missing(consumer, p)
        if isinstance(v, Left):
            raise Lost(
                f"node {consumer!r} on {_side(here)} reads the value of {v.node!r}, which "
                f"stayed on {_side(v.host)}: it cannot travel ({v.why or 'no codec'}). "
                f"Run {consumer!r} where {v.node!r} runs (.at({v.host!r})), or make "
                f"{v.node!r} return something that pickles"
            )
        return v

    def input_of(n: str) -> Any:
        ps = preds[n]
        if not ps:
            if n not in inputs:
                raise MissingInput(
                    f"root node {n!r} was given no input: pass g.forward(x) to feed every "
                    f"root, or feeds={{{n!r}: x, ...}} to feed each"
                )
            return inputs[n]
        if len(ps) == 1:
            return read(n, ps[0])
        return FanIn({p: read(n, p) for p in ps})

    for far, near in shape.waves:
        pending = []
        for unit, outside, roots, answers in far:
            stretch = Stretch(
                host=unit.host,
                nodes=unit.nodes,
                given={p: values[p] if p in values else given[p] for p in outside},
                given_keys={p: keys.get(p) for p in outside} if naming else {},
                inputs={m: inputs[m] for m in roots if m in inputs},
                naming=naming,
                training=training,
                wanted=answers,
            )
            pending.append(remote.submit(stretch))
        if meanwhile is not None:
            meanwhile()
            meanwhile = None
        for n in near:
            if n in hits:
                values[n] = hits[n]
                out.hits.append(n)
                continue
            with span(node_name(graph, n), "node"):
                if n in mapped and keeper is not None:
                    values[n], ran = _per_item(graph, n, input_of(n), keeper, here, training)
                elif n in cached and keeper is not None and keys.get(n):
                    node, x = graph.catalog[n], input_of(n)
                    values[n], ran = _holes.computed(graph, n, node, functools.partial(
                        run_node, graph.reports.get(n, n), node, x, here, training)), True
                else:
                    values[n], ran = run_node(graph.reports.get(n, n), graph.catalog[n],
                                              input_of(n), here, training), True
            if not ran:  # every item was kept
                out.hits.append(n)
                continue
            out.ran.append(n)
            out.pids[n] = pid
            if n in cached and n not in mapped and keeper is not None and keys.get(n):
                keep(graph, keeper, n, keys[n], values[n])
        for p in pending:
            got = p.result()
            values.update(got.values)
            keys.update({k: v for k, v in got.keys.items() if v is not None or k not in keys})
            out.ran += got.ran
            out.hits += got.hits
            out.pids.update(got.pids)
    return out


def _per_item(graph, n: str, x: Any, keeper: Any, here: str | None,
              training: bool) -> tuple[Any, bool]:
    """A ``.mapped()`` node's value, its batch answered item by item from the keeper;
    and whether the node ran (for the misses)."""
    node = graph.catalog[n]
    name = graph.reports.get(n, n)
    return _holes.mapped()(graph, n, node, x, keeper,
                           lambda sub: run_node(name, node, sub, here, training))


@dataclass(frozen=True)
class _Shape:
    """What a walk runs, read off the graph alone: the same for every batch of a run."""

    cached: frozenset[str]  # cached nodes run on this side
    wanted: frozenset[str]  # what the caller reads
    needed: frozenset[str]  # what must run (or be a hit) to produce it
    todo: tuple[str, ...]
    # per wave of units(...) of todo: the stretches sent away, each with what it reads from
    # outside, its roots and what it answers with; then the nodes run here
    waves: tuple[tuple[tuple[tuple[Unit, tuple[str, ...], tuple[str, ...], tuple[str, ...]],
                             ...], tuple[str, ...]], ...]


# per graph, the shapes of the walks asked of it (a handful: one per order, side, wanted
# and set of hits); a graph's preds, placement and memory never change once built
_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shape_of(graph, order: tuple[str, ...], here: str | None, wanted, hits) -> _Shape:
    wanted = order if wanted is None else tuple(wanted)
    memo = _shapes.setdefault(graph, {})
    k = (order, here, wanted, frozenset(hits))
    shape = memo.get(k)
    if shape is None:
        preds = graph.preds
        needed = set(wanted)
        for n in reversed(order):
            if n in needed and n not in hits:
                needed.update(preds[n])
        todo = tuple(n for n in order if n in needed)
        waves = tuple(
            (tuple(_sent(graph, u, needed, wanted) for u in wave if u.host is not None),
             tuple(u.nodes[0] for u in wave if u.host is None))
            for wave in units(preds, todo, graph.placement.hosts, here))
        shape = _Shape(cached_here(graph, here), frozenset(wanted), frozenset(needed), todo,
                       waves)
        if len(memo) > 256:  # bounded: hits that vary batch to batch make new shapes
            memo.clear()
        memo[k] = shape
    return shape


def _sent(graph, unit: Unit, needed, wanted) -> tuple:
    """A stretch's reading of the graph: what it is handed from outside, its roots, and
    what it answers with (what the caller or a reader outside it needs)."""
    inside = set(unit.nodes)
    preds = graph.preds
    outside = tuple(dict.fromkeys(p for m in unit.nodes for p in preds[m] if p not in inside))
    roots = tuple(m for m in unit.nodes if not preds[m])
    answers = tuple(m for m in unit.nodes if m in needed and (
        m in wanted or any(c not in inside for c in graph.successors(m))))
    return unit, outside, roots, answers


def node_name(graph, n: Any) -> str:
    """What a trace calls a node of a run: a trainer's two positions say which they are."""
    if isinstance(graph.catalog[n], Learning):
        return f"enter {n.node}" if isinstance(n, tuple) else f"leave {n}"
    return f"forward {graph.reports.get(n) or n}"


def _missing(consumer: str, p: str):
    raise MissingInput(f"node {consumer!r} needs the value of {p!r}, which was not handed over")


def _side(host: str | None) -> str:
    return "the coordinator (here)" if host is None else f"worker {host!r}"


def run_graph(graph, input, *, store=None, workers=None, feeds=None, training=False):
    """``Graph.forward``: check what is declared, open the keeper, walk, read the sinks."""
    if graph.memory.cached:
        cacheable(graph)
    check_settled(graph)
    keeper = _holes.keeper(store)
    check_workers(workers)
    remote = None
    if graph.placement.hosts:
        remote = _holes.transport().runtime_for(graph, workers)
    if feeds is not None and not isinstance(feeds, Mapping):
        raise MissingInput(f"feeds= takes a dict {{root_id: value}}, not a "
                           f"{type(feeds).__name__}; the graph's roots are {list(graph.roots)}")
    inputs = {r: (feeds[r] if r in feeds else _missing_feed(r, feeds)) for r in graph.roots} \
        if feeds is not None else {r: input for r in graph.roots}
    sinks = graph.sinks
    out = walk(graph, graph.plan.order, inputs=inputs, keeper=keeper,
               naming=naming(graph, keeper, remote), training=training, remote=remote,
               wanted=sinks)
    return output(graph, out.values, sinks)


def provision(graph, workers=None) -> None:
    """``Graph.provision``: send each worker the nodes placed on it and the graph's
    identity, starting local workers if needed."""
    _holes.transport().runtime_for(graph, workers).provision(graph)


def close(graph) -> None:
    """``Graph.close``: stop the worker processes this graph's runs started (idempotent)."""
    _holes.transport().release(graph)


def output(graph, values: Mapping[str, Any], sinks: tuple[str, ...] | None = None) -> Any:
    """The sink's bare value, or ``{sink: value}`` with several sinks (``graph.sinks``,
    unless the caller read them once already); a sink left on a worker raises ``Lost``."""
    sinks = graph.sinks if sinks is None else sinks
    result = {}
    for s in sinks:
        v = values[s]
        if isinstance(v, Left):
            raise Lost(
                f"the value of sink {s!r} stayed on worker {v.host!r} ({v.why}): it cannot "
                f"travel to the coordinator. Make {s!r} return something that pickles"
            )
        result[s] = bare(v)
    return result[sinks[0]] if len(sinks) == 1 else result


def _missing_feed(root: str, feeds) -> Any:
    raise MissingInput(
        f"root node {root!r} was given no input: feeds has {sorted(feeds)}; add {root!r}"
    )
