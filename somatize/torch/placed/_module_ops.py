"""What a ``Link`` (``_here.py``) sends to its placed module's worker about the module
itself, each a typed value that does its own work there (``op.apply(placed)``), queued
and sent with the next call: the modes (``train()``/``eval()``), the parameters'
``requires_grad`` and the weights written here. Plain attributes travel as
``_ordinary.SetAttributes``, the optimizers' operations as ``_mirror_ops``'; the math
settings go through the ``Session`` (``follow_math``).

    ops = [SetModes((True, False)), SetWeights({"0.weight": w})]   # queued here
    for op in ops: op.apply(placed)                               # over there
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SetModes:
    """Each module's ``training`` flag, in ``module.modules()`` order."""
    modes: tuple

    def apply(self, placed: Any) -> None:
        for m, mode in zip(placed.module.modules(), self.modes, strict=True):
            m.training = mode


@dataclass(frozen=True)
class SetRequiresGrad:
    """Each parameter's ``requires_grad`` (``toggle_optimizer``, ``requires_grad_()`` here)."""
    flags: tuple

    def apply(self, placed: Any) -> None:
        for p, flag in zip(placed.module.parameters(), self.flags, strict=True):
            p.requires_grad_(flag)


@dataclass(frozen=True)
class SetWeights:
    """Weights and buffers written here (SWA, ``load_state_dict``), by state-dict key."""
    weights: dict

    def apply(self, placed: Any) -> None:
        copy_into(placed.module, self.weights)


def copy_into(module: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (by state-dict key) into ``module``'s own tensors, in place."""
    with torch.no_grad():
        for k, t in module.state_dict(keep_vars=True).items():
            if k in weights:
                t.copy_(weights[k])
