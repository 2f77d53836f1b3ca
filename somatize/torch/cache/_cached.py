"""A frozen module's forward that keeps its outputs in a store, by name: what
``SomatizeCache(store=..., modules=["body"])`` installs on the module it names.

The name of an output is known before the module runs: ``key_of_node(the module's class,
the digest of its state and settings, the salt, [the key of the call's input], the call's
autocast state)``, the graph route's naming with the call's input as the root's. A call
whose name is kept is answered from the store (a hit), on the device the module's output
would be on; otherwise the module runs and its output is kept (a miss). What is kept
beside it is the code fingerprint of every class in the module's tree. It travels
with the module (pickled, store path and all) when the module is placed on a worker, and
does the same over there, where ``counts_there`` reads its counts.

    cached = CachedForward(module, "body", "/scratch/soma")
    module.forward = cached              # an instance attribute: the class is untouched
    module(x); module(x)                 # cached.misses == 1, cached.hits == 1
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from ... import _holes
from ..._errors import Refused
from ..._keys import changed, classes_of, fingerprint, key_of_input, key_of_node
from ..._reads import code_in, reads_of
from ..._say import say_once
from ._draws import drawing_refused, held_generators
from ._freeze import digest_of, named_state
from ._named import held_code, instance_forward
from ._watch import Watch


class CachedForward:
    """The module's forward, answered from ``store`` when its output is kept there.

    Args:
        module: the frozen module (its state must not change while it is cached).
        path: its path in the LightningModule, for messages and what is kept beside values.
        store: a directory path (opened where the call runs), or a Keeper when the
            module runs in this process only.
        previous: a forward already installed on the module (an instance attribute).
        salt: a string in every name, for what the key cannot see (an attribute holding
            an object: with a salt it is left out of the name instead of refused).
    """

    # somatize's own, set on the module as ``forward``: not one of the module's attributes
    # for the placed route to carry (on a placed module the cache is installed over there)
    stands_in = True

    def __init__(self, module: torch.nn.Module, path: str, store: Any, previous: Any = None,
                 salt: str | None = None):
        self.module, self.path, self.previous, self.salt = module, path, previous, salt
        self.store = os.path.abspath(store) if isinstance(store, (str, os.PathLike)) else store
        self.kind = type(module).__name__
        self.code = ""
        self.hits = 0
        self.misses = 0
        self.active = True  # off: the module's own forward, nothing kept or read
        self._keeper: Any = None
        self._watch: Watch | None = None  # what the digest was taken over, watched
        self.digest: str | None = None
        self.settle()

    def settle(self) -> None:
        """Digest the module's state and settings as they are now (after a checkpoint's
        weights are loaded); refused when a setting cannot be named."""
        state, pieces = named_state(self.module, self.path, self.salt)
        if self.previous is not None:  # a forward of yours on the instance: what runs
            held: list = []
            pieces.append(instance_forward(self.previous, self.module, held))
            state += [(f"forward.{k}", t) for k, t in held]
        self.digest = digest_of(state, pieces)
        self._watch = Watch(self.module, state)
        classes = classes_of(self.module, type(self.module))  # a child's code is its too
        self.code = json.dumps(fingerprint(*classes), sort_keys=True)
        self.generators = held_generators([self.module], classes)  # drawn from: refused
        self.reads = reads_of(classes, held_code([self.module]) + tuple(code_in(self.previous)))
        self.state()  # a global that cannot be named is refused now, not at the first call

    def state(self) -> str | None:
        """What the module computes with, now: its state's digest and what its code reads
        of the globals (read at every call)."""
        reads = self.reads.now(f"module {self.path!r}", self.salt)
        return f"{self.digest or ''}|{reads}" if reads else self.digest

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.run(*args, **kwargs)
        _refuse_trained_input(self.path, args, kwargs)
        if self._watch is None or self.reads is None or self._watch.changed(self.module):
            self.settle()  # its weights or settings were written: a new name
        key = key_of_node(self.kind, self.state(), self.salt, [
            ("", key_of_input(args[0] if len(args) == 1 and not kwargs else (args, kwargs)))])
        keeper = self.keeper()
        if key is None or keeper is None:
            return self.run(*args, **kwargs)  # an input without a codec: said by key_of_input
        kept = keeper.get_many([f"value/{key}"])[0]
        if kept is not None:
            self.hits += 1
            self._check_code(kept.meta)
            return on_device(kept.value, self.device(args, kwargs))
        self.misses += 1
        out = self.compute(*args, **kwargs)
        keeper.put(f"value/{key}", out, {"node": self.path, "class": self.kind,
                                         "fingerprint": self.code})
        return out

    def compute(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward, for a miss: refused if it drew from torch's random
        generator (its output is then no function of what its key names)."""
        if self.reads is not None and self.reads.seeds:  # it seeds the generator itself
            return self.run(*args, **kwargs)
        return drawing_refused(f"module {self.path!r} ({self.kind})",
                               lambda: self.run(*args, **kwargs),
                               f"SomatizeCache(modules=...) for {self.path!r}", self.generators)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def device(self, args: tuple, kwargs: dict) -> torch.device | None:
        """Where the module's output would be: its weights' device, else its input's."""
        for t in self.module.parameters():
            return t.device
        for t in self.module.buffers():
            return t.device
        return _first_device([*args, *kwargs.values()])

    def keeper(self) -> Any:
        if self._keeper is None:
            self._keeper = _holes.keeper(self.store)  # over there, opened over there
        return self._keeper

    def _check_code(self, meta: Any) -> None:
        if meta.get("fingerprint", self.code) == self.code:
            return
        try:
            diff = changed(json.loads(meta["fingerprint"]), json.loads(self.code))
        except ValueError:
            diff = ["(unreadable)"]
        if diff:
            say_once(("cached module code", self.path, tuple(diff)),
                     f"module {self.path!r} ({self.kind}): the output kept under its name was "
                     f"produced by different code ({', '.join(diff)} changed since). It is used "
                     "anyway: the code is not part of the name. If the change alters what it "
                     "produces, use another store")

    def __getstate__(self) -> dict:
        if not isinstance(self.store, str):
            raise Refused(
                f"module {self.path!r} is cached in a {type(self.store).__name__}, which cannot "
                "travel to the worker it runs on: give SomatizeCache a directory path "
                "(store='/scratch/soma', one the worker can reach)")
        state = dict(self.__dict__)
        state["_keeper"] = None  # opened again where it lands
        state["_watch"] = None  # tensors there have versions of their own: digest again
        state["reads"] = None  # globals there are its own: read again
        state["generators"] = ()  # found again when it settles over there
        return state


def on_device(value: Any, device: torch.device | None) -> Any:
    """``value`` (fresh from the store) with its tensors on ``device``, dtypes kept; its
    containers are rebuilt or written in place, keeping their classes."""
    if device is None or device.type == "cpu":
        return value  # the store gives tensors on the CPU
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        items = [on_device(v, device) for v in value]
        return value._make(items) if hasattr(value, "_make") else type(value)(items)
    if isinstance(value, list):
        value[:] = [on_device(v, device) for v in value]
    elif isinstance(value, MutableMapping):
        for k in list(value):
            value[k] = on_device(value[k], device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            object.__setattr__(value, f.name, on_device(getattr(value, f.name), device))
    return value


def _first_device(flat: list) -> torch.device | None:
    while flat:
        v = flat.pop(0)
        if isinstance(v, torch.Tensor):
            return v.device
        if isinstance(v, (tuple, list)):
            flat[:0] = list(v)
        elif isinstance(v, Mapping):
            flat[:0] = list(v.values())
    return None


def _refuse_trained_input(path: str, args: tuple, kwargs: dict) -> None:
    # the prefix rule, as far as a call shows it: an input that asks for a gradient comes
    # from something that still trains, and a value read from the store sends none back
    if not torch.is_grad_enabled():
        return
    flat = [*args, *kwargs.values()]
    while flat:
        v = flat.pop()
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                raise Refused(
                    f"module {path!r} is cached, but its input asks for a gradient: it comes "
                    "from something that still trains, and an output read from the store "
                    "sends no gradient back to it. Cache a module fed by the data or by "
                    f"frozen modules only, or leave {path!r} out of SomatizeCache(modules=...)")
        elif isinstance(v, (tuple, list)):
            flat.extend(v)
        elif isinstance(v, dict):
            flat.extend(v.values())


def counts_there(live: Any, placed: str, inside: str) -> tuple[int, int]:
    """Over there: ``(hits, misses)`` of the cached forward of module ``inside`` of the
    placed module ``placed`` (run against the worker's live graph)."""
    module = live.catalog[placed].module
    module = module.get_submodule(inside) if inside else module
    cached = module.__dict__.get("forward")
    return (cached.hits, cached.misses) if isinstance(cached, CachedForward) else (0, 0)
