"""somatize: run a graph of nodes across processes, train the half that is not here,
and never compute twice what is settled.

    from somatize import Graph, Node, Done, Opaque

    g = Graph.somatize(Body().at("gpu") >> Head())
    y = g.forward(x)

The core (graph, plan, stages, keys) imports no torch; ``somatize.torch`` does.
"""

import sys

# _compiled first: where no bytecode is written, the others' code objects are kept
from . import _compiled, _holes, _log  # noqa: F401 (_compiled installs itself)
from ._errors import (
    ContractError,
    GraphError,
    Lost,
    MissingInput,
    NoGradient,
    NotSettled,
    Refused,
    SomatizeError,
    StoreError,
    WorkerError,
)
from ._graph import Graph, Memory, Placement
from ._keeper import Keeper, Kept
from ._keys import key_of_input, key_of_node
from ._learning import Learning
from ._memory import cacheable
from ._node import Ctx, Node
from ._plan import Plan
from ._stages import cut, stages
from ._values import Blob, Done, Opaque, codec

__all__ = [
    "Blob", "ContractError", "Ctx", "Done", "Graph", "GraphError", "Keeper", "Kept", "Learning",
    "Lost", "Memory", "MissingInput", "NoGradient", "Node", "NotSettled", "Opaque", "Placement",
    "Plan", "Refused", "SomatizeError", "StoreError", "WorkerError", "cacheable", "codec", "cut",
    "key_of_input", "key_of_node", "stages",
]
__version__ = "0.1.0"
_log.install()


def _module_node(obj):
    # an nn.Module composed with a node is wrapped, only if torch is already loaded
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        from .torch import node

        return node(obj)
    return None


def _open_keeper(store):
    from .store import open_keeper

    return open_keeper(store)


def _runtime_for(graph, workers):
    from .remote import runtime_for

    return runtime_for(graph, workers)


def _trace_start(runtime):
    from .remote._tracing import begin

    return begin(runtime)


def _trace_collect(runtime, offsets, end=False):
    from .remote._tracing import collect

    return collect(runtime, offsets, end)


def _answer_mapped(*args):
    from .torch.cache._per_item import answer_mapped

    return answer_mapped(*args)


def _computed(*args):
    from .torch.cache._per_item import computed_node

    return computed_node(*args)


def _release(graph):
    if "somatize.remote" in sys.modules:  # nothing was started if it was never imported
        from .remote import release

        release(graph)


# the defaults that fill the core's holes, each importing its layer at first use
_holes.adapt(_module_node)
_holes.fill(keeper=_open_keeper, mapped=_answer_mapped, computed=_computed,
            transport=_holes.Transport(
    _runtime_for, _release, _trace_start, _trace_collect))


def __getattr__(name):
    # a Worker is the transport's: load it only when asked for
    if name == "Worker":
        from .remote import Worker

        return Worker
    raise AttributeError(f"module 'somatize' has no attribute {name!r}")
