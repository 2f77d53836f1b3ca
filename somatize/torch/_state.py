"""A node's state as torch sees it, shared by every room: the modules a node holds, its
tensors by name, copying them out and back in (the one way weights are copied into a
module or node), and bringing a state to the CPU to travel (the one way a worker sends
weights or an optimizer's state back).

    state_of(node)                   # [("lin.weight", t), ...]
    weights = snapshot(node); restore(node, weights)
    on_cpu(module.state_dict())      # a detached CPU copy, as it crosses
"""

from __future__ import annotations

import copy
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
    """Copy ``weights`` (by name) into a node's state (a module's: by state-dict key), in
    place; names it lacks are passed over."""
    with torch.no_grad():
        for k, t in state_of(node):
            if k in weights:
                t.copy_(weights[k])


def on_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor in it detached on the CPU (dicts, lists and
    tuples walked; anything else deep-copied): what crosses to another process, where
    RPC has no device maps."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(on_cpu(v) for v in value)
    return copy.deepcopy(value)
