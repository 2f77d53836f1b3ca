"""Values handed across a stage boundary of a split step: leaves that ask for their
gradient, and the gradients owed to them summed."""

from __future__ import annotations

from typing import Any

import torch

from ..._values import Opaque, bare


def leaf_of(value: Any, trained: bool) -> tuple[Any, tuple[torch.Tensor, torch.Tensor] | None]:
    """A value handed across a stage boundary: a tensor that can take a gradient (a
    trainer's detached output, or one with history here) becomes a leaf that asks for it."""
    t = bare(value)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not (
            trained or t.requires_grad):
        return value, None
    leaf = t.detach().requires_grad_()
    return (Opaque(leaf) if isinstance(value, Opaque) else leaf), (t, leaf)


def asks_grad(value: Any) -> bool:
    """Whether ``value`` is a floating tensor that wants a gradient here and now."""
    t = bare(value)
    return (torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point())


def plus(a: Any, b: Any) -> Any:
    """``a + b``, either of them None for nothing."""
    if a is None:
        return b
    return a if b is None else a + b
