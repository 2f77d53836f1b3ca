"""The placed weights here, never read stale: during fit a placed module's parameters
and buffers here are of a subclass whose first read after the module stepped (or ran,
when it has buffers) over there brings them up to date, in one round trip. A fit where
nothing here reads them brings nothing back. They pickle and deep-copy as plain
``Parameter`` and ``Tensor`` (current, as read), and their class is theirs again after fit.

    fresh(link)    # at install: link.module's weights answer reads with current values
    unfresh(link)  # at uninstall
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .._private import DATA_READ, METADATA_READS, plainly, rebuild_parameter

_owner: dict[int, Any] = {}  # id(tensor) -> the Link whose module holds it


def _read(tensors: Any) -> None:
    for t in tensors:
        if isinstance(t, (list, tuple)):  # foreach ops take lists
            _read(t)
        else:
            link = _owner.get(id(t))
            if link is not None and link.stale:
                link.bring()


def _torch_function(cls, func, types, args=(), kwargs=None):
    if func not in METADATA_READS:
        _read(args)
        if kwargs:
            _read(kwargs.values())
        if func == DATA_READ:  # (a method-wrapper: a new object each time it is read)
            _exposed(args[0])
    with plainly():  # what comes out is a plain tensor: nothing of this class spreads
        return func(*args, **(kwargs or {}))


def _exposed(t: torch.Tensor) -> None:
    # .data shares the storage but not the version counter: a write through it is found
    # by value, against what it held when handed out
    link = _owner.get(id(t))
    if link is not None and id(t) not in link.sent.exposed:
        with plainly():
            link.sent.exposed[id(t)] = t.detach().clone()


class FreshParameter(torch.nn.Parameter):
    """A placed module's parameter here, during fit (read: brought up to date first)."""

    __torch_function__ = classmethod(_torch_function)

    def __reduce_ex__(self, proto):
        _read([self])
        with plainly():
            return (rebuild_parameter(),
                    (self.data, self.requires_grad, {}))  # a plain Parameter, when loaded

    def __deepcopy__(self, memo):
        _read([self])
        with plainly():
            out = torch.nn.Parameter(copy.deepcopy(self.data, memo), self.requires_grad)
        memo[id(self)] = out
        return out


class FreshBuffer(torch.Tensor):
    """A placed module's buffer here, during fit (read: brought up to date first)."""

    __torch_function__ = classmethod(_torch_function)

    def __reduce_ex__(self, proto):
        _read([self])
        with plainly():
            return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        _read([self])
        with plainly():
            out = copy.deepcopy(self.as_subclass(torch.Tensor), memo)
        memo[id(self)] = out
        return out


def fresh(link: Any) -> None:
    """Make ``link.module``'s plain parameters and buffers answer reads current."""
    made = link.__dict__.setdefault("freshened", [])  # (a replaced one keeps it till fit ends)
    for p in link.module.parameters():
        if type(p) is torch.nn.Parameter:
            p.__class__ = FreshParameter
            _owner[id(p)] = link
            made.append(p)
    for b in link.module.buffers():
        if type(b) is torch.Tensor:
            b.__class__ = FreshBuffer
            _owner[id(b)] = link
            made.append(b)


def unfresh(link: Any) -> None:
    """Their own classes again."""
    for t in link.__dict__.pop("freshened", []):
        if type(t) is FreshParameter:
            t.__class__ = torch.nn.Parameter
        elif type(t) is FreshBuffer:
            t.__class__ = torch.Tensor
        _owner.pop(id(t), None)
