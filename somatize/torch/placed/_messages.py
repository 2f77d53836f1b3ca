"""What travels between a placed module here and over there: a ``Call`` (its arguments
and the state it runs under) answered by an ``Answer`` (its outputs, the advanced RNG
state), or by a ``Raised``. A structure travels with its tensors apart (TensorPipe sends
them beside the pickle) and the rest ``Pickled``, a marker where each tensor stood;
arguments that are distinct tensors only (``Spread``), and an output that is one tensor
or a tuple of distinct tensors (``Bare``), travel with no pickle at all.

    call = Call(0, tensors, spread(args, kwargs) or Pickled(dumps((spec, plain))), ...)
    answer = _call(live, "encoder", call)        # over there: an Answer, or a Raised
    tensors, plain = pack(flat); flat == unpack(tensors, plain)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Spread:
    """Arguments that are distinct tensors only, in the call's ``tensors``: the first
    ``positional`` of them positional, the rest the keyword arguments ``names``."""

    positional: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class Bare:
    """An output that is distinct tensors only, the answer's ``tensors``: one tensor
    (``lone``), or a tuple of them."""

    lone: bool


ONE, TUPLE = Bare(True), Bare(False)


@dataclass(frozen=True)
class Pickled:
    """A structure that travels pickled: ``(tree spec, plain leaves)``, with
    ``TensorHere`` where each of the message's tensors stood (``Same``: an argument's)."""

    blob: bytes


@dataclass(frozen=True)
class Call:
    """One call of a placed module, as it travels: numbered in order, its arguments'
    tensors (detached, on the CPU) and how their structure travels, which of them ask
    for dL/d(argument), and what it runs under here: grad and inference mode, the RNG
    state (with ``Worker(rng="derived")``, the int seed the call draws from instead),
    the ops queued since the last message (done first), the autocast in force
    (``(device type, dtype, cache)`` each), the default dtype; and the device the
    module computes on over there."""

    number: int
    tensors: list
    structure: Spread | Pickled
    needs: list[bool]
    grad: bool
    inference: bool
    rng: torch.Tensor | int
    ops: list
    autocast: list
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class Answer:
    """A call's answer: the output's tensors (detached, on the CPU) and how its
    structure travels, which of them carry a gradient over there, the RNG state the
    forward left (None when the call drew from a seed of its own), the worker's pid,
    whether the call waits for a backward (a frozen module's does not), and how many
    uses the forward made of each argument that asks for a gradient, when one was used
    more than once (``_there.fans``)."""

    tensors: list
    structure: Bare | Pickled
    alive: list[bool]
    rng: torch.Tensor | None
    pid: int
    kept: bool
    uses: tuple = ()


class TensorHere:
    """Marks, among a structure's plain leaves, where a tensor stood (it travels apart)."""


class Same:
    """An argument tensor the forward left as it was: the caller's own tensor ``i`` (a
    leaf to the walker, not a dataclass it would walk into)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def pack(flat: list) -> tuple[list, list]:
    """The tensors of ``flat``, and its other leaves with ``TensorHere`` in their place."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    return tensors, [TensorHere if isinstance(t, torch.Tensor) else t for t in flat]


def unpack(tensors: Any, plain: list) -> list:
    it = iter(tensors)
    return [next(it) if p is TensorHere else p for p in plain]


_spreads: dict[tuple, Spread] = {}  # one per (positional, names): made once, not per call


def spread(args: tuple, kwargs: dict) -> Spread | None:
    """How the arguments travel when every one is a tensor and no tensor stands twice
    (no pickled structure); else None."""
    n = len(args)
    if not all(isinstance(a, torch.Tensor) for a in args) or not all(
            isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    ids = {id(a) for a in args}
    ids.update(id(v) for v in kwargs.values())
    if len(ids) != n + len(kwargs):
        return None
    key = (n, tuple(kwargs))
    got = _spreads.get(key)
    if got is None:
        got = _spreads[key] = Spread(*key)
    return got


def bare(out: Any) -> Bare | None:
    """How an output travels when it is one tensor or a tuple of distinct tensors (no
    pickled structure); else None."""
    if isinstance(out, torch.Tensor):
        return ONE
    if type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out) \
            and len({id(t) for t in out}) == len(out):
        return TUPLE
    return None
