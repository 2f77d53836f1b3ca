"""somatize: run a graph of nodes across processes, train the half that is not here,
and never compute twice what is settled.

    from somatize import Graph, Node, Done, Opaque

    g = Graph.somatize(Body().at("gpu") >> Head())
    y = g.forward(x)

The core (graph, plan, stages, keys) imports no torch; ``somatize.torch`` does.
"""

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
from ._memory import cacheable
from ._node import Ctx, Node
from ._plan import Plan
from ._stages import cut, stages
from ._values import Blob, Done, Opaque, codec

__all__ = [
    "Blob", "ContractError", "Ctx", "Done", "Graph", "GraphError", "Keeper", "Kept", "Lost",
    "Memory", "MissingInput", "NoGradient", "Node", "NotSettled", "Opaque", "Placement", "Plan",
    "Refused", "SomatizeError", "StoreError", "WorkerError", "cacheable", "codec", "cut",
    "key_of_input", "key_of_node", "stages",
]
__version__ = "0.1.0"


def __getattr__(name):
    # Worker and Learning live beside what fills them; load them only when asked for
    if name == "Worker":
        from .remote import Worker

        return Worker
    if name == "Learning":
        from ._learning import Learning

        return Learning
    raise AttributeError(f"module 'somatize' has no attribute {name!r}")
