"""A node's state as torch sees it, shared by every room: the modules a node holds, its
tensors by name, and copying them out and back in.

    state_of(node)                   # [("lin.weight", t), ...]
    weights = snapshot(node); restore(node, weights)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._keys import code_tree
from .._memory import params_of


def modules_of(node: Any) -> list[tuple[str, torch.nn.Module]]:
    """The ``nn.Module`` attributes a node holds, by attribute name."""
    if isinstance(node, torch.nn.Module):
        return [("", node)]
    return sorted((k, v) for k, v in vars(node).items() if isinstance(v, torch.nn.Module))


def classes_in(node: Any) -> list[type]:
    """The classes of every module a node holds, children included: their code is its."""
    return [type(m) for _, module in modules_of(node) for m in module.modules()]


code_tree(classes_in)


def state_of(node: Any) -> list[tuple[str, torch.Tensor]]:
    """A node's state as named tensors: its modules' state_dicts, else its parameters()."""
    state = [
        (f"{name}.{k}" if name else k, v)
        for name, m in modules_of(node)
        for k, v in m.state_dict(keep_vars=True).items()
    ]
    if not state:
        state = [(str(i), p) for i, p in enumerate(params_of(node))]
    return state


def snapshot(node: Any) -> dict[str, torch.Tensor]:
    """A copy of a node's state, by name."""
    return {k: t.detach().clone() for k, t in state_of(node)}


def restore(node: Any, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (by name) into a node's state."""
    with torch.no_grad():
        for k, t in state_of(node):
            if k in weights:
                t.copy_(weights[k])
