"""What crosses between processes: an outcome's values that can travel, RRefs for
values whose readers are all on other workers, and code (a graph, a function) by value.
A worker is sent the nodes it runs and the graph's identity: every other node stands
in its catalog as an ``Elsewhere`` (its id and kind), so a node that never leaves here
need not pickle.

    blob = graph_for(graph, "gpu")                 # on the coordinator: what "gpu" gets
    answer = travelling(graph, outcome, stretch)   # on the worker
    x = resolve(given["body"])                     # on the worker that reads it
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from .._engine import Outcome
from .._errors import Refused, WorkerError
from .._graph import Graph
from .._learning import Learning, node_of
from .._node import kind_of
from .._values import Left, Opaque


class _Probe(pickle.Pickler):
    # tensors always travel (the RPC pickler sends them as tensors): never copy them here
    def persistent_id(self, obj):
        import torch

        return id(obj) if isinstance(obj, torch.Tensor) else None


def why_not(value: Any) -> str | None:
    """None when ``value`` can travel; else why it cannot."""
    import torch

    v = value.value if isinstance(value, Opaque) else value
    if v is None or isinstance(v, (torch.Tensor, int, float, str, bytes, bool)):
        return None
    try:
        _Probe(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(v)
    except Exception as e:
        return f"{type(v).__name__} does not pickle: {e}"
    return None


def travelling(graph, out: Outcome, stretch) -> Outcome:
    """The outcome a worker answers with: what is wanted and can travel, else ``Left``.

    A value every reader of which sits on another worker answers as an RRef, so it
    goes from here to there without passing through the coordinator.
    """
    from torch.distributed.rpc import RRef

    inside = set(stretch.nodes)
    values: dict[str, Any] = {}
    for n in stretch.wanted:
        if n not in out.values:
            continue
        v = out.values[n]
        why = why_not(v)
        if why is not None:
            values[n] = Left(n, stretch.host, why)
        elif _read_only_elsewhere(graph, n, inside, stretch.host):
            values[n] = RRef(v)
        else:
            values[n] = v
    return Outcome(values=values, keys=dict(out.keys), ran=list(out.ran), hits=list(out.hits),
                   pids=dict(out.pids))


def _read_only_elsewhere(graph, n: str, inside: set[str], host: str) -> bool:
    readers = [c for c in graph.successors(n) if c not in inside]
    if not readers or n in graph.sinks:
        return False
    return all(graph.placement.get(c) not in (None, host) for c in readers)


def resolve(value: Any) -> Any:
    """A value handed to a stretch: an RRef is fetched from its owner, straight to here."""
    from torch.distributed.rpc import PyRRef  # what an RRef arrives as, as rpc exports it

    return value.to_here() if isinstance(value, PyRRef) else value


_PLACED, _PLACED_MESSAGES = ("Call", "Answer"), "somatize.torch.placed._messages"
_PLACED_THERE = "somatize.torch.placed._there"
_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})


def bytes_of(value: Any) -> int:
    """The tensor bytes in what crosses (nested containers, outcomes and stretches too,
    a placed module's calls and answers)."""
    import torch

    tensor, plain = torch.Tensor, (str, bytes, int, float, bool, type(None))
    todo, total, seen = [value], 0, 0
    while todo and seen < 10000:  # bounded: a pathological structure is not walked whole
        v = todo.pop()
        seen += 1
        t = type(v)  # the exact types first: no call for what every message holds
        if t in _PLAIN:
            continue
        if t is tuple or t is list:
            todo.extend(v)
            continue
        if isinstance(v, plain):
            continue
        if isinstance(v, tensor):
            total += v.nbytes if v.layout == torch.strided else v.numel() * v.element_size()
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, Opaque):
            todo.append(v.value)
        elif isinstance(v, Outcome):
            todo.append(v.values)
        elif hasattr(v, "given") and hasattr(v, "inputs"):  # a Stretch
            todo += [v.given, v.inputs]
        elif type(v).__name__ == "Envelope":
            todo += [v.signal, v.then]
        elif type(v).__name__ in _PLACED and type(v).__module__ == _PLACED_MESSAGES:
            todo += [v.tensors, v.rng, *getattr(v, "ops", ())]  # (the rest holds none)
        elif type(v).__name__ == "Backward" and type(v).__module__ == _PLACED_THERE:
            todo.append(v.grads)  # a backward queued with a call
    return total


def dumps_apart(obj: Any) -> tuple[bytes, list]:
    """``obj`` pickled by value (``somatize.torch._pickling``), with the tensors left out
    of the bytes and handed back beside them: the transport sends tensors as they are (no
    copy of a module's weights in a pickle)."""
    import torch

    from ..torch._pickling import by_value

    tensors: list = []
    seen: dict[int, int] = {}

    class Apart(by_value()):
        def persistent_id(self, o):
            if isinstance(o, torch.Tensor) and type(o) in (torch.Tensor, torch.nn.Parameter):
                if id(o) not in seen:  # a tensor tied in two places stays one
                    seen[id(o)] = len(tensors)
                    tensors.append(o.detach() if type(o) is torch.Tensor else o)
                return seen[id(o)]
            return None

    buf = io.BytesIO()
    Apart(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue(), tensors


def loads_apart(blob: bytes, tensors: list) -> Any:
    """What ``dumps_apart`` gave, whole again."""

    class Together(pickle.Unpickler):
        def persistent_load(self, pid):
            return tensors[pid]

    return Together(io.BytesIO(blob)).load()


class Elsewhere:
    """What stands in a worker's catalog for a node that runs somewhere else: its id and
    kind (what the worker compares catalogs by), never the node itself."""

    def __init__(self, node: Any, kind: str, host: str | None):
        self.node, self._soma_kind, self.host = node, kind, host

    def forward(self, x: Any, ctx: Any):
        where = "the coordinator" if self.host is None else f"worker {self.host!r}"
        raise WorkerError(
            f"node {self.node!r} ({self._soma_kind}) was asked to run on worker {ctx.host!r}, "
            f"but it runs on {where} and was not sent here: place it with "
            f".at({ctx.host!r}) to run it there")

    def __repr__(self) -> str:
        return f"Elsewhere({self.node!r}, {self._soma_kind})"


def graph_for(graph, host: str) -> tuple[bytes, list]:
    """The graph as ``host``'s worker is sent it, pickled: the nodes placed there (a
    trainer with the node it trains, one object wherever it stands), an ``Elsewhere`` for
    every other; ids, edges, placement and memory whole. A placed node that does not
    pickle is ``Refused``, named."""
    place = graph.placement
    sent = Graph({n: o if place.get(n) == host else Elsewhere(n, kind_of(o), place.get(n))
                  for n, o in graph.catalog.items()},
                 graph.edges, place, graph.memory, graph.reports)
    try:
        # one blob: an object in two positions stays one object there; its tensors beside
        return dumps_apart(sent)
    except Exception as e:
        raise _refusal(sent, host, e) from None


def _placed(o: Any) -> bool:
    from ..torch.placed._there import Placed

    return isinstance(o, Placed)


def _placed_refusal(name: str, o: Any, host: str, why: Exception) -> Refused:
    # the module as the user placed it: its path in place=, and what to do
    import torch

    parametrized = [p for p, m in o.module.named_modules()
                    if torch.nn.utils.parametrize.is_parametrized(m)]
    if parametrized:
        where = f"{name}.{parametrized[0]}" if parametrized[0] else name
        advice = (f"{where} is parametrized (torch.nn.utils.parametrizations: weight_norm, "
                  "spectral_norm...), which torch pickles only through its state_dict. Use "
                  "torch.nn.utils.weight_norm (the hook form, which pickles), or leave "
                  f"{name!r} unplaced")
    else:
        advice = ("Make it picklable (a __getstate__ that leaves out locks, files and sockets, "
                  f"rebuilt in __setstate__), or leave {name!r} unplaced")
    return Refused(
        f"module {name!r} ({type(o.module).__name__}) is placed (place={{{name!r}: {host!r}}}) "
        f"but cannot be sent to worker {host!r}: it does not pickle ({type(why).__name__}: "
        f"{str(why).split('. ')[0]}). {advice}")


def _refusal(sent, host: str, e: Exception) -> Refused:
    from ..torch._pickling import dumps

    # the object at fault: the user's nodes are tried before the trainers standing by them
    mine = [(n, o) for n, o in sent.catalog.items() if not isinstance(o, Elsewhere)]
    for n, o in sorted(mine, key=lambda item: isinstance(item[1], Learning)):
        try:
            dumps(o)
        except Exception as why:
            if _placed(o):  # placed by name: SomatizeStrategy(place=...)
                return _placed_refusal(node_of(n), o, host, why)
            what = (f"the trainer of node {node_of(n)!r} ({kind_of(o)})"
                    if isinstance(o, Learning) else f"node {node_of(n)!r} ({kind_of(o)})")
            return Refused(
                f"{what} is placed on worker {host!r} but cannot be sent there: it does not "
                f"pickle ({type(why).__name__}: {why}). Run it here (drop .at({host!r})), or "
                "make it picklable (a __getstate__ that leaves out locks, files and "
                "sockets, rebuilt in __setstate__)")
    return Refused(f"the graph sent to worker {host!r} does not pickle "
                   f"({type(e).__name__}: {e}): the nodes placed there are {[n for n, _ in mine]}")
