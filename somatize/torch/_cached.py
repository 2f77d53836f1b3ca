"""A frozen module's forward that keeps its outputs in a store, by name: what
``SomatizeCache(store=..., modules=["body"])`` installs on the module it names.

The name of an output is known before the module runs: ``key_of_node(the module's class,
the digest of its state, no salt, [the key of the call's input])``, the graph route's
naming with the call's input as the root's. A call whose name is kept is answered from
the store (a hit); otherwise the module runs and its output is kept (a miss). It travels
with the module (pickled, store path and all) when the module is placed on a worker, and
does the same over there, where ``counts_there`` reads its counts.

    cached = CachedForward(module, "body", "/scratch/soma")
    module.forward = cached              # an instance attribute: the class is untouched
    module(x); module(x)                 # cached.misses == 1, cached.hits == 1
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .. import _holes
from .._errors import Refused
from .._keys import changed, fingerprint, key_of_input, key_of_node
from .._say import say_once
from ._freeze import state_digest, state_of


class CachedForward:
    """The module's forward, answered from ``store`` when its output is kept there.

    Args:
        module: the frozen module (its state must not change while it is cached).
        path: its path in the LightningModule, for messages and what is kept beside values.
        store: a directory path (opened where the call runs), or a Keeper when the
            module runs in this process only.
        previous: a forward already installed on the module (an instance attribute).
    """

    def __init__(self, module: torch.nn.Module, path: str, store: Any, previous: Any = None):
        self.module, self.path, self.previous = module, path, previous
        self.store = os.path.abspath(store) if isinstance(store, (str, os.PathLike)) else store
        self.kind = type(module).__name__
        self.code = json.dumps(fingerprint(type(module)), sort_keys=True)
        self.hits = 0
        self.misses = 0
        self.active = True  # off: the module's own forward, nothing kept or read
        self._keeper: Any = None
        self._versions: tuple | None = None
        self.digest: str | None = None
        self.settle()

    def settle(self) -> None:
        """Digest the module's state as it is now (after a checkpoint's weights are loaded)."""
        state = state_of(self.module)
        self.digest = state_digest(self.module)
        self._versions = tuple(t._version for _, t in state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.run(*args, **kwargs)
        _refuse_trained_input(self.path, args, kwargs)
        if self._versions != tuple(t._version for _, t in state_of(self.module)):
            self.settle()  # its weights were written (loaded, sent over): a new name
        key = key_of_node(self.kind, self.digest, None, [
            ("", key_of_input(args[0] if len(args) == 1 and not kwargs else (args, kwargs)))])
        keeper = self.keeper()
        if key is None or keeper is None:
            return self.run(*args, **kwargs)  # an input without a codec: said by key_of_input
        kept = keeper.get_many([f"value/{key}"])[0]
        if kept is not None:
            self.hits += 1
            self._check_code(kept.meta)
            return kept.value
        self.misses += 1
        out = self.run(*args, **kwargs)
        keeper.put(f"value/{key}", out, {"node": self.path, "class": self.kind,
                                         "fingerprint": self.code})
        return out

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

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
        state["_versions"] = None  # tensors there have versions of their own: digest again
        return state


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
