"""Where a placed module's calls go: the module's own to its ``Link`` (they run over
there); its children's, refused here during fit (their weights here are a stale copy)
and run here outside it. All through ``route_calls``: no attribute of the module's own,
nothing in its pickles. The module's own hooks run here, around the call; its
children's run over there, where the children run: one put on a child here after the
module was sent goes before the next call (``SetHooks``). What took the calls away (an
in-place ``compile()``, before fit or during it) is refused by name, and so is a hook
that reads this process's context variables is sent with them carried (``carried``:
their values travel with each call).

    routing = Routing(link); routing.install()    # module(x) calls link.forward(x)
    routing.check(); routing.hooks(ops)           # before each step, each call
    routing.uninstall()                           # its own calls again
"""

from __future__ import annotations

import functools
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import Refused
from .._pickling import dumps, token
from .._private import (
    global_hook_tables,
    hook_count,
    hook_dicts,
    hooks_of,
    own_call,
    route_calls,
    routed_to,
    set_hooks,
)
from ._reach import contexts

_NO = object()

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SetHooks:
    """The forward and backward hooks of children, by path, as they are here (pickled:
    by value where the script's), put there in place of theirs."""

    blob: bytes

    def apply(self, placed: Any) -> None:
        modules = dict(placed.module.named_modules())
        for path, hooks in pickle.loads(self.blob).items():
            set_hooks(modules[path], hooks)
        placed.__dict__.pop("watch", None)  # what the hooks reach, looked up again


class Routing:
    """The calls of ``link.module`` and of its children, routed (once installed)."""

    def __init__(self, link: Any):
        self.link = link
        self.children: list[tuple[str, torch.nn.Module]] = []  # (path, child)
        self.routes: dict[int, Any] = {}  # id(module) -> what its calls are routed to
        self.hooked: list[int] = []  # per child: its hooks when last looked at
        self.routed: list = []
        self.carried: dict[str, Any] = {}  # the context variables children's hooks read
        self.every = global_hook_tables()  # torch's hooks for every module (refused)

    def install(self) -> None:
        module = self.link.module
        name = self.link.name
        if type(module).forward is torch.nn.Module.forward:  # a ModuleList, a ModuleDict
            kids = [f"{name}.{k}" for k, _ in module.named_children()]
            raise Refused(
                f"{name!r} is placed (place={{{name!r}: {self.link.host!r}}}) but is a "
                f"{type(module).__name__}, which has no forward of its own: the model calls "
                "its children one by one, so nothing would run over there. Place its "
                f"children by name (place={{{', '.join(repr(k) + ': ...' for k in kids[:2])}"
                f"{', ...' if len(kids) > 2 else ''}}}) or the module that holds {name!r} "
                "and calls them")
        for path, m in module.named_modules():
            if routed_to(m) is not None:  # compiled in place before fit
                where = f"{name}.{path}" if path else name
                raise Refused(
                    f"{where}.compile() was called in place before fit, and {name!r} is "
                    f"placed (place={{{name!r}: {self.link.host!r}}}): the worker would run "
                    "it uncompiled, silently. Remove the in-place compile() of what you place "
                    f"(compile the modules that stay here), or leave {name!r} unplaced")
        self.children = [(path, child) for path, child in module.named_modules()
                         if child is not module]
        self.routes = {id(module): self._called}
        for path, child in self.children:
            self.routes[id(child)] = functools.partial(self._here, path, child)
        self.routed = list(module.modules())
        self.carried = {}
        for m in self.routed:
            route_calls(m, self.routes[id(m)])
        for path, child in self.children:
            self._contexts(path, child)
        self.hooked = [hook_count(child) for _, child in self.children]
        self.dicts = [d for _, child in self.children for d in hook_dicts(child)]
        self.lengths = list(map(len, self.dicts))

    def uninstall(self) -> None:
        for m in self.routed:
            if routed_to(m) is self.routes.get(id(m)):
                route_calls(m, None)
        self.routes, self.routed = {}, []

    def reinstall(self) -> None:
        """Route again, after the module's structure changed (a child replaced)."""
        self.uninstall()
        self.install()

    def _called(self, *args: Any, **kwargs: Any) -> Any:
        # the placed module called: its own hooks run here, around its forward over there
        link, module = self.link, self.link.module
        if not hook_count(module):
            return link.forward(*args, **kwargs)
        had = module.__dict__.get("forward", _NO)
        module.__dict__["forward"] = link.forward
        try:
            return own_call(module, *args, **kwargs)
        finally:
            if had is _NO:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = had

    def check(self) -> None:
        """Refuse, naming the module, what took the module's calls away (compile())."""
        name, host = self.link.name, self.link.host
        for m in (self.link.module, *(c for _, c in self.children)):
            if id(m) in self.routes and routed_to(m) is not self.routes[id(m)]:
                path = next((f"{name}.{p}" for p, c in self.children if c is m), name)
                raise Refused(
                    f"{path}.compile() was called in place on a module placed on worker "
                    f"{host!r} (inside {name!r}): compiled here it would run here, on a "
                    "stale copy of its weights. Compile before placing it "
                    f"(torch.compile(module) as a submodule), or leave {name!r} unplaced")

    def _contexts(self, path: str, child: torch.nn.Module) -> None:
        # a hook that reads this process's context variables: each is carried, its value
        # here set over there around every call (what the hooks change in it comes back)
        for fn in (f for d in hooks_of(child).values() if isinstance(d, dict)
                   for f in d.values() if callable(f)):
            for var in contexts(fn):
                self.carried.setdefault(token(var), var)

    def hooks(self, ops: list) -> None:
        """Queue the hooks put on children here (or removed) since the module was sent:
        they run over there, where the children run. A hook registered for every module
        is refused: it would run around the module here, never around its children."""
        pre, post = self.every
        if pre or post:
            name = self.link.name
            raise Refused(
                f"a forward hook registered for every module is on here "
                f"(torch.nn.modules.module.register_module_forward_hook or _pre_hook): it runs "
                f"around {name!r} itself here, but not around its children, which run on "
                f"worker {self.link.host!r}. Register it on the modules it is for (a hook put "
                f"on a child of {name!r} runs there), or leave {name!r} unplaced")
        lengths = list(map(len, self.dicts))  # (at C speed: nothing put, nothing to do)
        if lengths == self.lengths:
            return
        self.lengths = lengths
        changed = {}
        for k, (path, child) in enumerate(self.children):
            now = hook_count(child)
            if now != self.hooked[k]:
                self._contexts(path, child)
                changed[path] = hooks_of(child)
                self.hooked[k] = now
        if changed:
            try:
                blob = dumps(changed)
            except Exception as e:
                name = self.link.name
                raise Refused(
                    f"a hook registered here on {name}.{', '.join(changed)} (placed: "
                    f"place={{{name!r}: {self.link.host!r}}}) cannot be sent to the worker "
                    f"where that module runs ({type(e).__name__}: {e}): register a hook that "
                    f"pickles (a function, not a lambda over an open file), or leave "
                    f"{name!r} unplaced") from None
            ops.append(SetHooks(blob))

    def _here(self, path: str, child: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # a child of the placed module called on its own, here
        self.check()
        link = self.link
        if link.fitting:
            raise Refused(
                f"{link.name}.{path} is part of {link.name!r}, which is placed on worker "
                f"{link.host!r}: during fit its weights here are a stale copy, so it cannot "
                f"run here. Call {link.name!r} itself (it runs over there), or read its "
                "weights after trainer.strategy.sync()")
        return own_call(child, *args, **kwargs)  # outside fit: the copy here is current
