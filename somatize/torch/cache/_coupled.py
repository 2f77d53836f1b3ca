"""Layers that mix the rows of a batch, which per-item memory refuses (a row kept from one
batch would be wrong in another): BatchNorm in train mode, or without running stats.

    refuse_coupled(module, "backbone")      # raises Refused naming the layer
"""

from __future__ import annotations

from typing import Any

import torch

from ..._errors import Refused
from .._private import batchnorm_base
from .._state import modules_of


def coupled_layers(module: torch.nn.Module) -> list[tuple[str, str]]:
    """The layers of ``module`` that mix the rows of a batch: ``[(path, why)]``."""
    out = []
    for name, m in module.named_modules():
        if isinstance(m, batchnorm_base()):  # SyncBatchNorm too
            if m.training:
                out.append((name, "is in train mode (it normalises by the batch's statistics)"))
            elif not m.track_running_stats:
                out.append((name, "has track_running_stats=False (it normalises by the "
                                  "batch's statistics, even in eval mode)"))
    return out


def refuse_coupled(module: torch.nn.Module, path: str) -> None:
    """Raise ``Refused`` naming the first layer of ``module`` that couples rows."""
    for name, why in coupled_layers(module):
        layer = f"{path}.{name}" if name else path
        raise Refused(
            f"{path!r} is kept per item, but its layer {layer!r} "
            f"({type(module.get_submodule(name)).__name__}) {why}: an item's output would "
            "depend on the other items of its batch, and a kept row would be wrong in "
            "another batch. Put that layer in eval mode with track_running_stats=True, or "
            "keep the module per batch (leave out per_item=True / .mapped())")


def refuse_coupled_node(n: str, node: Any) -> None:
    """``refuse_coupled`` for each module a graph node holds (a wrapped module: its own)."""
    for attr, m in modules_of(node):
        wrapped = getattr(node, "_soma_kind", None) is not None
        refuse_coupled(m, f"{n}.{attr}" if attr and not wrapped else n)
