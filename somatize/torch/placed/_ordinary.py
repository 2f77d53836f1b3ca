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
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import Refused
from .._pickling import dumps
from .._private import ROUTED_CALL, plainly, registered, structure
from ._looks import looks, mutable
from ._messages import pack
from ._tree import tree_flatten

_NONE = object()
# what every module holds in its __dict__ (its registries, hooks, mode; what routes its
# calls): sent as structure, hooks and modes, never as attributes
_OWN = frozenset(vars(torch.nn.Module())) | {ROUTED_CALL}


def _names(m: torch.nn.Module) -> tuple:
    return tuple(k for k, v in m.__dict__.items() if k not in _OWN and not (
        k == "forward" and (getattr(v, "stands_in", False) is True or getattr(
            getattr(v, "__self__", None), "stands_in", False))))


def _values(m: torch.nn.Module, names: tuple) -> tuple:
    return tuple(map(m.__dict__.get, names, itertools.repeat(_NONE)))  # read per call


def _sendable(v: Any) -> Any:
    # a tensor attribute travels as its value (no history of this process's graph)
    return v.detach() if isinstance(v, torch.Tensor) and v.requires_grad and not v.is_leaf \
        else v


@dataclass(frozen=True)
class SetAttributes:
    """Attributes set, changed in place or deleted here, by module path: ``(set,
    deleted)``, pickled (by value where the script's: a lambda, a partial of it)."""

    blob: bytes

    def apply(self, placed: Any) -> None:
        changed, gone = pickle.loads(self.blob)
        modules = dict(placed.module.named_modules())
        for path, attrs in changed.items():
            modules[path].__dict__.update(attrs)
        for path, names in gone.items():
            for k in names:
                modules[path].__dict__.pop(k, None)
        placed.__dict__.pop("deep", None)  # what can change in place, looked up again


class Attributes:
    """The attributes of a module and its children (any value: numbers, tensors,
    functions, partials, enums, lists, dicts, objects), as last sent over there. Looked
    at per call, cheaply: each value by identity, and only those that can change in place
    (a list, a dict, a tensor, an object) by how they look (``_looks``); the names again
    only when a module's ``__dict__`` grew or shrank."""

    def __init__(self, module: torch.nn.Module, name: str = "module"):
        self.name = name
        self.look(module)

    def look(self, module: torch.nn.Module) -> None:
        """Take the module's attributes, as they are now, as sent."""
        named = list(module.named_modules())
        self.paths = [p for p, _ in named]
        self.modules = [m for _, m in named]
        self.names = [_names(m) for m in self.modules]
        self.sizes = [len(m.__dict__) for m in self.modules]
        self.sent = [_values(m, ns) for m, ns in zip(self.modules, self.names, strict=True)]
        self.deep: list[tuple] = []
        self.looked: list[tuple] = []
        for i in range(len(self.modules)):
            self._deep(i)
        self.dicts = [m.__dict__ for m in self.modules]
        self._seen()

    def _seen(self) -> None:
        # each module's __dict__ as it is (a shallow copy): the per-call look's first step
        self.copies = [dict(d) for d in self.dicts]
        self.still = not any(self.deep)

    def quiet(self) -> bool:
        """Whether nothing can have changed: every module's ``__dict__`` holds the values
        it held and none of them can change in place. At C speed: a dict compares each
        value by identity first, so ``==`` runs no ``__eq__`` when nothing was replaced
        (and one that was is looked at by ``changed``)."""
        if not self.still:
            return False
        try:
            return all(map(operator.eq, self.dicts, self.copies))
        except Exception:  # a replaced value's __eq__ (a tensor's) answers no bool
            return False

    def _deep(self, i: int) -> None:
        d = self.modules[i].__dict__
        deep = tuple(k for k in self.names[i] if k in d and mutable(d[k]))
        if i < len(self.deep):
            self.deep[i], self.looked[i] = deep, tuple(looks(d[k]) for k in deep)
        else:
            self.deep.append(deep)
            self.looked.append(tuple(looks(d[k]) for k in deep))

    def changed(self) -> SetAttributes | None:
        """What changed here since last sent (and is now taken as sent), or None."""
        changed: dict = {}
        gone: dict = {}
        for i, m in enumerate(self.modules):
            d = m.__dict__
            resized = len(d) != self.sizes[i]
            if resized:  # an attribute added or removed: the names again
                was = dict(zip(self.names[i], self.sent[i], strict=True))
                self.sizes[i], self.names[i] = len(d), _names(m)
                lost = [k for k in was if k not in d]
                if lost:
                    gone[self.paths[i]] = lost
                self.sent[i] = tuple(was.get(k, _NONE) for k in self.names[i])
            now = _values(m, self.names[i])
            sent = self.sent[i]
            new = {}
            if not all(map(operator.is_, now, sent)):  # by identity: no __eq__ of theirs
                new = {k: v for k, v, w in zip(self.names[i], now, sent, strict=True)
                       if v is not w}
                self.sent[i] = now
            deep = self.deep[i]
            if deep:
                now_looks = tuple(looks(d.get(k)) for k in deep)
                if now_looks != self.looked[i]:
                    for k, was, is_ in zip(deep, self.looked[i], now_looks, strict=True):
                        if is_ != was and k not in new and k in d:  # changed in place: appended to
                            new[k] = d[k]
                    self.looked[i] = now_looks
            if resized or new and (any(k in new for k in deep)
                                   or any(map(mutable, new.values()))):
                self._deep(i)  # replaced by a value that can change in place: look at it
            lost = [k for k, v in new.items() if v is _NONE]
            for k in lost:
                del new[k]
                gone.setdefault(self.paths[i], []).append(k)
            if new:
                changed[self.paths[i]] = {k: _sendable(v) for k, v in new.items()}
        self._seen()
        if not changed and not gone:
            return None
        return SetAttributes(self._pickled(changed, gone))

    def _pickled(self, changed: dict, gone: dict) -> bytes:
        try:
            return dumps((changed, gone))
        except Exception:
            pass
        for path, attrs in changed.items():  # which one: named in the refusal
            for k, v in attrs.items():
                try:
                    dumps(v)
                except Exception as e:
                    where = f"{self.name}.{path}" if path else self.name
                    raise Refused(
                        f"{where}.{k} was set here to {type(v).__name__} {v!r:.60}, which "
                        f"cannot be sent to the worker running {self.name!r} "
                        f"({type(e).__name__}: {e}). Set it to a value that pickles (a "
                        "function defined at a module's top level, a functools.partial of "
                        f"one, plain data), or leave {self.name!r} unplaced") from None
        raise Refused(f"the attributes changed on {self.name!r} cannot be sent to its worker")

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
            self._deep(i)
        self._seen()


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


def unsendable(name: str, host: str, args: tuple, kwargs: dict, e: Exception) -> Refused:
    """The refusal of a call whose arguments do not pickle, naming the argument."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()]
    which = "its arguments"
    for what, value in named:
        try:
            flat, spec = tree_flatten(value)
            dumps((spec, pack(flat)[1]))
        except Exception as why:
            which, e = f"{what} ({type(value).__name__})", why
            break
    return Refused(
        f"{name!r} was called with {which}, which cannot be sent to worker {host!r} where "
        f"{name!r} runs (place={{{name!r}: {host!r}}}; {type(e).__name__}: {e}). Pass what "
        "pickles (a list instead of a generator, plain data instead of an open file or a "
        f"lock), or leave {name!r} unplaced")
