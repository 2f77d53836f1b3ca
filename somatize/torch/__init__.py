"""somatize for tensors: wrap modules as nodes, settle frozen nodes, keep tensors,
and train a graph — in one piece or in stages, here and on workers.

    from somatize.torch import node, freeze, parameters, Split, Trainer
"""

from ._codec import from_blob, to_blob
from ._module import ModuleNode, node
from .cache._freeze import freeze, state_digest
from .graph._graphmodule import GraphModule
from .graph._refuse import parameters
from .graph._split import Split
from .graph._trainer import Trainer

__all__ = [
    "GraphModule", "ModuleNode", "Split", "Trainer", "freeze", "from_blob", "node", "parameters",
    "state_digest", "to_blob",
]
