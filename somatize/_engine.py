"""The engine: walks a graph (or a stretch of it) wave by wave, here, handing remote
stretches to the transport, with each value's key travelling beside it.

    outcome = walk(graph, graph.plan.order, inputs={"body": x})
    outcome.values["head"], outcome.keys["head"]
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import ContractError, Lost, MissingInput
from ._keys import changed, fingerprint, key_of_input, key_of_node
from ._memory import cacheable, check_settled, state_digest
from ._node import Ctx, kind_of
from ._plan import Unit, units
from ._say import say_once
from ._values import Done, FanIn, Left, Opaque, bare


@dataclass
class Outcome:
    """What a walk produced: values by node (``Left`` for what stayed behind), and keys."""

    values: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str | None] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    hits: list[str] = field(default_factory=list)


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


@dataclass(frozen=True)
class Named:
    """What is known of a walk before anything runs: every key, and the cached values
    the keeper already holds (by node, their code fingerprints checked)."""

    keys: Mapping[str, str | None]
    hits: Mapping[str, Any]


def look_up(
    graph,
    order: Iterable[str],
    *,
    inputs: Mapping[str, Any],
    given_keys: Mapping[str, str | None] | None = None,
    here: str | None = None,
    keeper: Any = None,
) -> Named:
    """Name the nodes of ``order`` over ``inputs`` and ask ``keeper`` for the cached ones
    run on ``here``'s side: the part of a walk that runs no node."""
    keys = _name(graph, order, inputs, given_keys or {})
    hits: dict[str, Any] = {}
    if keeper is not None:
        cached = _cached_here(graph, here)
        ask = [n for n in order if n in cached and keys.get(n)]
        if ask:
            found = keeper.get_many([f"value/{keys[n]}" for n in ask])
            for n, kept in zip(ask, found, strict=True):
                if kept is not None:
                    _check_fingerprint(graph, n, kept.meta)
                    hits[n] = kept.value
    return Named(keys, hits)


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
    remote: Any = None,
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
            values[n] = run_node(graph.reports.get(n, n), graph.catalog[n], input_of(n), here,
                                 training)
            out.ran.append(n)
            if n in cached and keeper is not None and keys.get(n):
                _keep(graph, keeper, n, keys[n], values[n])
        for p in pending:
            got = p.result()
            values.update(got.values)
            keys.update({k: v for k, v in got.keys.items() if v is not None or k not in keys})
            out.ran += got.ran
            out.hits += got.hits
    return out


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
        shape = _Shape(_cached_here(graph, here), frozenset(wanted), frozenset(needed), todo,
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


def _cached_here(graph, here: str | None) -> frozenset[str]:
    return frozenset(n for n in graph.memory.cached if graph.placement.get(n) == here)


def _missing(consumer: str, p: str):
    raise MissingInput(f"node {consumer!r} needs the value of {p!r}, which was not handed over")


def _side(host: str | None) -> str:
    return "the coordinator (here)" if host is None else f"worker {host!r}"


def _name(graph, order, inputs, given_keys) -> dict[str, str | None]:
    keys: dict[str, str | None] = dict(given_keys)
    by_input: dict[int, str | None] = {}  # roots fed the same object are hashed once
    for n in order:
        ps = graph.preds[n]
        if ps:
            fed = [(p, keys.get(p)) for p in ps]
        else:
            # a root node is named like any other, over the key of what it is fed: two
            # encoders (or two checkpoints) fed one input must not share a name
            x = inputs.get(n)
            if id(x) not in by_input:
                by_input[id(x)] = key_of_input(x) if n in inputs else None
                if n in inputs and by_input[id(x)] is None:
                    what = type(bare(x)).__qualname__
                    say_once(("nameless input", n, what),
                             f"root {n!r} is fed a {what} that has no codec: nothing below it "
                             "is named, so nothing below it is kept (import somatize.torch "
                             "for tensors, or register a codec with somatize.codec)")
            fed = [("", by_input[id(x)])]
        node = graph.catalog[n]
        keys[n] = key_of_node(kind_of(node), state_digest(node), graph.memory.cached.get(n), fed)
    return keys


def _code_of(node: Any) -> type:
    return getattr(node, "_soma_code", None) or type(node)


# a class's fingerprint, read once per process: disassembling it costs milliseconds,
# more than a hit saves on a small node
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint_of(node: Any) -> str:
    cls = _code_of(node)
    if cls not in _fingerprints:
        _fingerprints[cls] = json.dumps(fingerprint(cls), sort_keys=True)
    return _fingerprints[cls]


def _keep(graph, keeper, n: str, key: str, value: Any) -> None:
    node = graph.catalog[n]
    meta = {"node": n, "class": kind_of(node), "fingerprint": _fingerprint_of(node)}
    keeper.put(f"value/{key}", value.value if isinstance(value, Opaque) else value, meta)


def _check_fingerprint(graph, n: str, meta: Mapping[str, str]) -> None:
    node = graph.catalog[n]
    now = _fingerprint_of(node)
    if meta.get("fingerprint") == now:
        return
    try:
        old = json.loads(meta.get("fingerprint", "{}"))
    except ValueError:
        old = {}
    diff = changed(old, json.loads(now))
    if diff:
        say_once(
            ("fingerprint", n, tuple(diff)),
            f"node {n!r} ({kind_of(node)}): the value kept under its name was produced by "
            f"different code ({', '.join(diff)} changed since). It is used anyway: the code "
            f"is not part of the name. If the change alters what {n!r} produces, say so in "
            f"its key with .cached(salt='v2')",
        )


def run_graph(graph, input, *, store=None, workers=None, feeds=None, training=False):
    """``Graph.forward``: check what is declared, open the keeper, walk, read the sinks."""
    from .store import open_keeper

    if graph.memory.cached:
        cacheable(graph)
    check_settled(graph)
    keeper = open_keeper(store)
    remote = None
    if graph.placement.hosts:
        from .remote import runtime_for

        remote = runtime_for(graph, workers)
    # keys are computed only where something cached can be kept (here or on a worker)
    naming = bool(graph.memory.cached) and (
        keeper is not None or bool(remote is not None and remote.keeps()))
    if graph.memory.cached and not naming:
        say_once(("nothing kept", id(graph)),
                 f"nodes {sorted(graph.memory.cached)} are .cached() but no store was given "
                 "(here or on a worker): nothing is kept. Pass store='/path/to/dir'")
    inputs = {r: (feeds[r] if r in feeds else _missing_feed(r, feeds)) for r in graph.roots} \
        if feeds is not None else {r: input for r in graph.roots}
    sinks = graph.sinks
    out = walk(graph, graph.plan.order, inputs=inputs, keeper=keeper, naming=naming,
               training=training, remote=remote, wanted=sinks)
    return output(graph, out.values, sinks)


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
