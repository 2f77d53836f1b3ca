"""Values that flow along a graph's edges, and the codecs that turn them into bytes.

A node returns ``Done(value)``. ``Opaque(x)`` marks a process-local object (a
tensor) for whoever must move or keep it; nodes are always handed the bare value.

    codec("tensor", torch.Tensor, dump=to_blob, load=from_blob)
    Done(Opaque(t)).value.value is t
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Done:
    """What a node's ``forward`` returns: the value it produced."""

    value: Any


class Opaque:
    """A process-local object (a tensor, a handle); ``.value`` gives it back."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value.value if isinstance(value, Opaque) else value

    def __repr__(self) -> str:
        return f"Opaque({type(self.value).__name__})"

    def __getstate__(self):
        return self.value

    def __setstate__(self, value):
        self.value = value


def bare(value: Any) -> Any:
    """The value a node is handed: Opaque unwrapped, inside fan-in dicts too."""
    if isinstance(value, Opaque):
        return value.value
    if type(value) is FanIn:
        return {k: bare(v) for k, v in value.items()}
    return value


class FanIn(dict):
    """The dict a node with several predecessors is handed, keyed by predecessor id."""


class Blob(NamedTuple):
    """An object as bytes: a safetensors dtype name, a shape, and the raw data."""

    dtype: str
    shape: tuple[int, ...]
    data: Any  # bytes-like (bytes, memoryview, mmap slice); never copied needlessly


@dataclass(frozen=True)
class Codec:
    """How an object of ``type`` becomes a :class:`Blob` and back; ``layout``: what of
    it, beside its bytes, a computation may read (a tensor's strides), as text ("" for
    the layout its blob has)."""

    kind: str
    type: type
    dump: Callable[[Any], Blob]
    load: Callable[[Blob], Any]
    layout: Callable[[Any], str] | None = None


_codecs: dict[str, Codec] = {}


def codec(kind: str, type: type, *, dump: Callable[[Any], Blob], load: Callable[[Blob], Any],
          layout: Callable[[Any], str] | None = None):
    """Register how an object of ``type`` is turned into bytes (``dump``) and back (``load``),
    and what of it beside its bytes is in an input's key (``layout``, see ``Codec``).

    ``somatize.torch`` registers the tensor's codec on import; register your own for
    other process-local types you want kept or hashed.
    """
    _codecs[kind] = Codec(kind, type, dump, load, layout)
    return _codecs[kind]


def codec_for(obj: Any) -> Codec | None:
    """The codec registered for ``obj``'s type (or a base class of it), or None."""
    for c in _codecs.values():
        if isinstance(obj, c.type):
            return c
    return None


def codec_named(kind: str) -> Codec | None:
    return _codecs.get(kind)


@dataclass(frozen=True)
class Left:
    """A value that stayed behind on ``host`` because it cannot travel (see ``Lost``)."""

    node: str
    host: str | None
    why: str = ""
