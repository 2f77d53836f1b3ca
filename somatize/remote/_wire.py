"""What crosses between processes: an outcome's values that can travel, RRefs for
values whose readers are all on other workers, and code (a graph, a function) by value.

    answer = travelling(graph, outcome, stretch)   # on the worker
    x = resolve(given["body"])                     # on the worker that reads it
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from .._engine import Outcome
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
    from torch._C._distributed_rpc import PyRRef  # what an RRef arrives as

    return value.to_here() if isinstance(value, PyRRef) else value


def dumps(obj: Any) -> bytes:
    """Code and objects by value where they are defined in ``__main__`` (cloudpickle)."""
    import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
