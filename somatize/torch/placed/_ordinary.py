"""What keeps a placed module ordinary, here: the plain attributes set on it or its
children (a dropout's ``p``, BatchNorm's ``track_running_stats``) sent before its next
call; what its forward left on its modules over there set here; the arguments it
changed in place over there changed here.

    seen = Attributes(module); ops.append(seen.changed())   # None when nothing changed
    leave(module_list, side); into(args_here, args_there, name)
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import Refused
from .._private import plainly, registered, structure

_NONE = object()
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _plain(v: Any) -> bool:
    if isinstance(v, tuple):
        return all(_plain(x) for x in v)
    return isinstance(v, _PLAIN)


def _names(m: torch.nn.Module) -> tuple:
    return tuple(k for k, v in m.__dict__.items() if k != "training" and _plain(v))


def _values(m: torch.nn.Module, names: tuple) -> tuple:
    return tuple(map(m.__dict__.get, names, itertools.repeat(_NONE)))  # read per call


@dataclass(frozen=True)
class SetAttributes:
    """Plain attributes changed here, by module index (``module.modules()`` order)."""

    changed: dict

    def apply(self, placed: Any) -> None:
        modules = list(placed.module.modules())
        for i, attrs in self.changed.items():
            modules[i].__dict__.update(attrs)


class Attributes:
    """The plain attributes of a module and its children, as last sent over there.
    Looked at per call, cheaply: the values of the plain attributes known, and the
    names again only when a module's ``__dict__`` grew or shrank."""

    def __init__(self, module: torch.nn.Module):
        self.modules = list(module.modules())
        self.names = [_names(m) for m in self.modules]
        self.sizes = [len(m.__dict__) for m in self.modules]
        self.sent = [_values(m, ns) for m, ns in zip(self.modules, self.names, strict=True)]

    def changed(self) -> SetAttributes | None:
        """What changed here since last sent (and is now taken as sent), or None."""
        changed = {}
        for i, m in enumerate(self.modules):
            d = m.__dict__
            if len(d) != self.sizes[i]:  # an attribute added or removed: the names again
                was = dict(zip(self.names[i], self.sent[i], strict=True))
                self.sizes[i], self.names[i] = len(d), _names(m)
                self.sent[i] = tuple(was.get(k, _NONE) for k in self.names[i])
            now = _values(m, self.names[i])
            if now != self.sent[i]:
                new = {k: v for k, v, w in zip(self.names[i], now, self.sent[i], strict=True)
                       if (v != w or type(v) is not type(w)) and _plain(v)}
                if new:
                    changed[i] = new
                self.sent[i] = now
        return SetAttributes(changed) if changed else None

    def left(self, side: list) -> None:
        """Set here what the forward left on the modules over there (an auxiliary loss)."""
        for i, k, v in side:
            m = self.modules[i]
            if registered(m, k):
                m.__dict__.pop(k, None)
                setattr(m, k, v)
            else:
                m.__dict__[k] = v
            # as over there already (nothing changed here since the call was sent)
            self.names[i], self.sizes[i] = _names(m), len(m.__dict__)
            self.sent[i] = _values(m, self.names[i])



class Shape:
    """A module's submodules, parameters and ``state_dict(keep_vars=True)`` entries, as
    last looked up: what each call reads of them (training modes, ``requires_grad``,
    version counters) is read from these lists, looked up again only when the module's
    structure changed (a child, parameter or buffer added, removed or replaced)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.look()

    def look(self) -> None:
        """Look the module's structure up again."""
        self.modules = list(self.module.modules())
        with plainly():
            self.params = list(self.module.parameters())
            state = self.module.state_dict(keep_vars=True)
        self.names, self.tensors = list(state), list(state.values())
        self._key = self._now()

    def _now(self) -> list:
        return structure(self.modules)

    def current(self) -> bool:
        """Look again if the structure changed since; whether it did."""
        now = self._now()  # compared by identity first: no tensor's __eq__ runs
        if len(now) == len(self._key) and all(
                len(a) == len(b) and all(map(operator.is_, a, b))
                for a, b in zip(now, self._key, strict=True)):
            return False
        self.look()
        return True


def into(here: Any, there: Any, name: str, where: str = "the arguments") -> None:
    """Make ``here`` (the caller's arguments) what the forward made of them over there,
    in place; refused, naming the module, where that cannot be done."""
    if here is there:
        return
    if isinstance(here, torch.Tensor) and isinstance(there, torch.Tensor):
        if here.shape != there.shape or here.dtype != there.dtype:
            raise Refused(f"{name!r} changed a tensor among {where} to another shape or dtype "
                          "over there: pass it a tensor it may change, or return the result")
        with torch.no_grad():
            here.copy_(there)
        return
    if type(here) is not type(there):
        raise Refused(f"{name!r} changed {where} over there in a way that cannot be made "
                      f"here ({type(here).__name__} became {type(there).__name__}): return "
                      "what it computes instead")
    if isinstance(here, list):
        for k in range(min(len(here), len(there))):
            _item(here, k, there[k], name, where)
        del here[len(there):]
        here.extend(there[len(here):])
    elif isinstance(here, dict):
        for k in [k for k in here if k not in there]:
            del here[k]
        for k, v in there.items():
            if k in here:
                _item(here, k, v, name, where)
            else:
                here[k] = v
    elif isinstance(here, tuple):
        if len(here) != len(there):
            raise Refused(f"{name!r} changed {where} over there: a tuple's length changed")
        for a, b in zip(here, there, strict=True):
            into(a, b, name, where)
    elif hasattr(here, "__dict__") and hasattr(there, "__dict__"):
        for k, v in vars(there).items():
            if k in vars(here):
                into(vars(here)[k], v, name, where)
            else:
                vars(here)[k] = v
    elif here != there:
        raise Refused(f"{name!r} changed {where} over there ({here!r} became {there!r}), "
                      "which cannot be changed here in place: return what it computes instead")


def _item(container: Any, k: Any, there: Any, name: str, where: str) -> None:
    here = container[k]
    if here is there:
        return
    if isinstance(here, (list, dict, torch.Tensor)) and type(here) is type(there) and (
            not isinstance(here, torch.Tensor) or here.shape == there.shape):
        into(here, there, name, where)
    else:
        container[k] = there
