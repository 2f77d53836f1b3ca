"""Where a placed module's calls go: the module's own to its ``Link`` (they run over
there); its children's, refused here during fit (their weights here are a stale copy)
and run here outside it. All through ``route_calls``: no attribute of the module's own,
nothing in its pickles. What took the calls away (an in-place ``compile()``) is
refused by name, and a hook put on a child here after the module was sent is said once
(it never runs: the child runs over there).

    routing = Routing(link); routing.install()    # module(x) calls link.forward(x)
    routing.check(); routing.catch_hooks()        # before each step, each call
    routing.uninstall()                           # its own calls again
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ..._errors import Refused
from .._private import hook_count, own_call, route_calls, routed_to

log = logging.getLogger(__name__)


class Routing:
    """The calls of ``link.module`` and of its children, routed (once installed)."""

    def __init__(self, link: Any):
        self.link = link
        self.children: list[tuple[str, torch.nn.Module]] = []  # (path, child)
        self.routes: dict[int, Any] = {}  # id(module) -> what its calls are routed to
        self.hooked: list[int] = []  # per child: its hooks when last looked at
        self.warned: set[str] = set()  # children whose late hooks were said

    def install(self) -> None:
        module = self.link.module
        self.children = [(path, child) for path, child in module.named_modules()
                         if child is not module]
        self.routes = {id(module): self.link.forward}
        for path, child in self.children:
            self.routes[id(child)] = functools.partial(self._here, path, child)
        for m in module.modules():
            route_calls(m, self.routes[id(m)])
        self.hooked = [hook_count(child) for _, child in self.children]

    def uninstall(self) -> None:
        for m in self.link.module.modules():
            if routed_to(m) is self.routes.get(id(m)):
                route_calls(m, None)
        self.routes = {}

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

    def catch_hooks(self) -> None:
        """A hook put on a child here since the module was sent never runs (the child runs
        over there): said once per child."""
        for k, (path, child) in enumerate(self.children):
            now = hook_count(child)
            if now > self.hooked[k] and path not in self.warned:
                self.warned.add(path)
                name = self.link.name
                log.warning("a hook was registered here on %s.%s, which runs on worker %r: "
                            "it does not run (the module was sent before it was put). "
                            "Register hooks before fit, so they travel with the module and "
                            "run over there (what they record stays there), or leave %r "
                            "unplaced", name, path, self.link.host, name)
            self.hooked[k] = now

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
