"""An ``nn.Module`` as a node: ``node(nn.Linear(8, 6))`` is a node with id ``linear``.

    g = Graph.somatize(node(encoder).frozen().cached() >> Head())
"""

from __future__ import annotations

from typing import Any

import torch

from .._node import Ctx, Node
from .._values import Done, Opaque


class ModuleNode(Node):
    """A node that calls an ``nn.Module`` on what it is given; known by the module's class."""

    def __init__(self, module: torch.nn.Module):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"node() takes an nn.Module, not {type(module).__name__}")
        self.module = module
        self._soma_kind = type(module).__name__
        self._soma_code = type(module)  # the fingerprint reads the module's code, not ours

    def forward(self, x: Any, ctx: Ctx) -> Done:
        return Done(Opaque(self.module(x)))

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def __repr__(self) -> str:
        return f"node({self.module!r})"


def node(module: torch.nn.Module) -> ModuleNode:
    """Wrap an ``nn.Module`` as a node (done for you when a module is composed with a node)."""
    return module if isinstance(module, ModuleNode) else ModuleNode(module)
