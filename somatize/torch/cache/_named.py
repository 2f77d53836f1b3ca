"""Settings: what a module computes with besides its state — the plain attributes of it and
of every module inside it (``eps``, ``momentum``, a dropout's ``p``, a ``scale``), named so
that changing one changes the key of what it produces.

    pieces, tensors = settings_of(body, "body")   # ["0.eps=f:1e-05", ...], [("0.mask", t)]

A setting is named by value when it is plain data: None, bools, numbers, strings, bytes,
``torch.dtype``/``torch.device``, enums, functions (by their qualified name), dataclass
instances of those, and tuples, lists, sets and dicts of them. A tensor that is not a
parameter or buffer is state: its content is digested with the rest. What cannot be named
(an arbitrary object) is refused, naming the attribute and what to do, unless ``salt``
says the caller names it. The autocast state of the call is registered here as part of
every key (``somatize._keys.call_state``), on both routes.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import weakref
from typing import Any

import torch
from blake3 import blake3

from ..._errors import Refused
from ..._keys import call_state
from .._private import ROUTED_CALL, own_tensors, version

# the device types whose autocast state is part of every key
_AUTOCAST = ("cpu", "cuda", "xpu", "mps")
# what torch keeps on every module for itself (hooks, registries, the train flag)
_BOOKKEEPING = frozenset(vars(torch.nn.Module())) | {"training"}
_MAX_DEPTH = 8


def autocast_state() -> str | None:
    """The autocast state of this call (device types where it is on, with their dtype):
    it changes what a module computes, so it is part of the name."""
    on = [f"{d}:{torch.get_autocast_dtype(d)}" for d in _AUTOCAST if torch.is_autocast_enabled(d)]
    return "autocast " + ",".join(on) if on else None


call_state(autocast_state)


class Unnamed(Exception):
    """A setting that cannot be named by value (``.args``: its path and its type)."""


def settings_of(module: torch.nn.Module, where: str,
                salt: str | None = None) -> tuple[list[str], list[tuple[str, torch.Tensor]]]:
    """The named settings of ``module`` and every module inside it, and the tensors held
    as plain attributes (state that no ``state_dict`` shows), by dotted name.

    Raises ``Refused`` for a setting that cannot be named, naming ``where`` and the
    attribute; with a ``salt`` such an attribute is left out (the salt names it).
    """
    pieces: list[str] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        pieces.append(f"{prefix}:class={type(m).__module__}.{type(m).__qualname__}")
        for k, v in vars(m).items():
            if k in _BOOKKEEPING or k.startswith("_soma") or _ours(k, v):
                continue
            name = f"{prefix}.{k}" if prefix else k
            try:
                pieces.append(f"{name}={_named(v, name, tensors, 0)}")
            except Unnamed as e:
                if salt is not None:
                    continue  # the caller's salt names what this attribute changes
                what, kind = e.args
                raise Refused(
                    f"module {where!r}: its attribute {what!r} holds a {kind}, which the "
                    "key of its cached outputs cannot name (a change to it would serve stale "
                    "outputs). Make it a buffer (register_buffer) or a plain value (a "
                    "number, string, tuple...), or give SomatizeCache a salt= (.cached(salt=) "
                    "on a graph) that you change whenever it changes what the module "
                    "computes") from None
    return pieces, tensors


def _ours(k: str, v: Any) -> bool:
    # a forward installed on the instance (the cache's), or where its calls are routed (a
    # placed module's, or compile()'s): code, whose fingerprint is kept beside the value,
    # not a setting
    return k in ("forward", ROUTED_CALL) and callable(v)


def _named(v: Any, name: str, tensors: list, depth: int) -> str:
    """A setting as text that differs whenever the value does."""
    if depth > _MAX_DEPTH:
        raise Unnamed(name, "structure nested too deep")
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return f"{type(v).__name__}:{v}"
    if isinstance(v, enum.Enum):
        return f"enum:{type(v).__module__}.{type(v).__qualname__}.{v.name}"
    if isinstance(v, torch.Tensor):
        tensors.append((name, v))  # by content, with the state (deduplicated there)
        return f"tensor:{name}"
    if isinstance(v, weakref.ref):
        return _named(v(), name, tensors, depth + 1)  # an RNN's _flat_weight_refs
    if isinstance(v, torch.nn.Module):
        return "module"  # walked as a module of its own
    if isinstance(v, types.FunctionType):  # an activation held as a function: its code
        return f"code:{v.__module__}.{v.__qualname__}:{blake3(v.__code__.co_code).hexdigest()}"
    if isinstance(v, types.MethodType):
        on = type(v.__self__).__qualname__
        return f"method:{on}.{_named(v.__func__, name, tensors, depth + 1)}"
    if isinstance(v, (types.BuiltinFunctionType, type)):
        return f"code:{v.__module__}.{v.__qualname__}"
    if isinstance(v, (tuple, list, set, frozenset)):
        items = [_named(x, f"{name}[{i}]", tensors, depth + 1) for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            items.sort()
        return f"{type(v).__name__}[{','.join(items)}]"
    if isinstance(v, dict):
        items = sorted(f"{_named(k, name, tensors, depth + 1)}:"
                       f"{_named(x, f'{name}[{k!r}]', tensors, depth + 1)}" for k, x in v.items())
        return f"dict[{','.join(items)}]"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        items = [f"{f.name}={_named(getattr(v, f.name), f'{name}.{f.name}', tensors, depth + 1)}"
                 for f in dataclasses.fields(v)]
        return f"{type(v).__module__}.{type(v).__qualname__}({','.join(items)})"
    raise Unnamed(name, type(v).__qualname__)


class Watch:
    """Tells cheaply, at every call, whether what ``named_state`` read may have changed
    since: a tensor written in place or replaced, a module swapped, an attribute set (by
    identity: an equal value set again only costs a new digest)."""

    def __init__(self, module: torch.nn.Module, state: list[tuple[str, torch.Tensor]]):
        self.versions = [(t, version(t)) for _, t in state]
        self.seen = _seen(module)

    def changed(self, module: torch.nn.Module) -> bool:
        """Whether the module may compute differently than when this watch was set."""
        return any(version(t) != v for t, v in self.versions) or not _same(
            _seen(module), self.seen)


def _seen(module: torch.nn.Module) -> list:
    # one pass: each module, its tensors by identity, and its own attributes with a
    # shallow copy of the containers among them
    return [(m, *own_tensors(m),
             [(k, v, (*v, *v.values()) if type(v) is dict else tuple(v)
               if type(v) is list else None)
              for k, v in m.__dict__.items() if k not in _BOOKKEEPING])
            for m in module.modules()]


def _same(now: list, then: list) -> bool:
    if len(now) != len(then):
        return False
    for (m, ps, bs, items), (m0, ps0, bs0, items0) in zip(now, then, strict=True):
        if m is not m0 or len(items) != len(items0) or not _identical(ps, ps0) or not (
                _identical(bs, bs0)):
            return False
        for (k, v, inner), (k0, v0, inner0) in zip(items, items0, strict=True):
            if k != k0 or v is not v0 or (inner is not None and not _identical(inner, inner0)):
                return False
    return True


def _identical(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
