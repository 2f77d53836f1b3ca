"""The drop-in route: submodules of an unmodified LightningModule placed on workers by
name, ``SomatizeStrategy(place={"encoder": "worker"})``. The model's author changes
nothing and imports nothing from somatize.

Each placed module runs (and trains) over there (``somatize.torch``'s ``Link``); here it
stays in place, so state dicts and checkpoints keep its own keys. Lightning's optimizers
keep its parameters (``.grad`` None here, so they skip them: indices, param groups and
schedulers see what they would in one piece); each optimizer is mirrored over there,
group by group, and its mirror steps when it steps, with the groups' hyper-parameters
as they are then. The copy here is brought up to date at epoch ends, before
validation and checkpoints, at teardown, and on ``trainer.strategy.sync()``.

    place = DropIn(model, {"encoder": "worker"}, optimizers, workers=None)
    place.stepped(optimizer); place.sync(); place.close()
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from typing import Any

import torch

from .._errors import Refused
from .._graph import Graph, Placement
from ..torch._placed import Link, Placed
from ..torch._step import Step

log = logging.getLogger(__name__)

_NOT_PER_PARAMETER = ("LBFGS", "ZeroRedundancyOptimizer")  # a closure, or sharded state


class DropIn:
    """The placed submodules of one LightningModule, their workers and their mirrors.

    Args:
        model: the LightningModule.
        place: ``{submodule path: worker name}`` (paths as ``get_submodule`` takes them).
        optimizers: Lightning's optimizers (they keep the placed parameters).
        workers: ``{worker name: Worker}``; embedded ones when not given.
    """

    def __init__(self, model: torch.nn.Module, place: Mapping[str, str],
                 optimizers: list, workers: Any = None, lightning_optimizers: list = ()):
        self.modules = _resolve(model, place)
        _refuse_tied(model, self.modules)
        self.optimizers = list(optimizers)
        placed = {id(p) for m in self.modules.values() for p in m.parameters()}
        for opt in self.optimizers:
            held = any(id(p) in placed for g in opt.param_groups for p in g["params"])
            if held and type(opt).__name__ in _NOT_PER_PARAMETER:
                raise Refused(
                    f"{type(opt).__name__} holds parameters of {sorted(self.modules)}, which "
                    "are placed on workers: it does not update each parameter on its own "
                    "(a closure re-evaluating the loss, or state sharded across ranks), so no "
                    "mirror over there can follow it. Use a per-parameter optimizer (SGD, "
                    "Adam, AdamW...) for the placed modules")
        graph = Graph({p: Placed(m) for p, m in self.modules.items()}, [],
                      Placement(dict(place)))
        self.step = Step(graph, workers=workers)  # sends each module, as it is now, once
        self.links = {p: Link(self.step, p, m, place[p]) for p, m in self.modules.items()}
        # per (optimizer index, path): the optimizer's groups holding placed parameters,
        # with those parameters' names inside the module
        self.groups: dict[tuple[int, str], list] = {}
        for i, opt in enumerate(self.optimizers):
            for path, m in self.modules.items():
                names = {id(p): n for n, p in m.named_parameters()}
                groups = [(gi, [names[id(p)] for p in g["params"] if id(p) in names])
                          for gi, g in enumerate(opt.param_groups)]
                groups = [(gi, ns) for gi, ns in groups if ns]
                if groups:
                    self.groups[(i, path)] = groups
                    self.links[path].mirror(i, opt, groups)
        self._zero_grads(list(lightning_optimizers))
        for link in self.links.values():
            link.install()
        for path, m in self.modules.items():
            n = sum(p.numel() for p in m.parameters())
            log.info("module %r (%s, %d parameters) runs and trains on worker %r; its weights "
                     "here are brought up to date at epoch ends, checkpoints and sync()",
                     path, type(m).__name__, n, place[path])

    def _zero_grads(self, wrappers: list) -> None:
        # zero_grad reaches the mirrors: with two optimizers stepped at different rates, a
        # gradient left over there must be cleared when the user clears it here
        self._patched = []
        for i, opt in enumerate(self.optimizers):
            paths = [p for (j, p) in self.groups if j == i]
            if not paths:
                continue
            for target in [opt, *[w for w in wrappers if getattr(w, "_optimizer", None) is opt]]:
                original = target.zero_grad

                def zero_grad(set_to_none: bool = True, _i=i, _original=original, _paths=paths):
                    _original(set_to_none=set_to_none)
                    for p in _paths:
                        self.links[p].zeroed(_i, set_to_none)

                target.zero_grad = zero_grad
                self._patched.append(target)

    # -- what the strategy tells it ----------------------------------------------------
    def fitting(self, on: bool) -> None:
        for link in self.links.values():
            link.fitting = on

    def stepped(self, optimizer: Any) -> None:
        """``optimizer`` stepped here: its mirrors step over there (sent with the next call)."""
        i = self._index(optimizer)
        if i is None:
            return
        for (j, path), groups in self.groups.items():
            if j == i:
                self.links[path].stepped(i, self.optimizers[i], groups)

    def sync(self) -> dict[tuple[int, str], dict]:
        """Bring the weights here up to date; return the mirrors' states by parameter name."""
        states = {}
        for path, link in self.links.items():
            for i, by_name in link.pull().items():
                states[(i, path)] = by_name
        return states

    def optimizer_state(self, optimizer: Any, state: dict) -> dict:
        """``state`` (the optimizer here's) with the placed parameters' entries from over
        there, under the indices one piece would give them."""
        i = self._index(optimizer)
        if i is None:
            return state
        order = [p for g in self.optimizers[i].param_groups for p in g["params"]]
        mirrors = self.sync()
        state = dict(state, state=dict(state["state"]))
        for path, m in self.modules.items():
            by_name = mirrors.get((i, path))
            if by_name is None:
                continue
            names = {id(p): n for n, p in m.named_parameters()}
            for k, p in enumerate(order):
                if id(p) in names:
                    if names[id(p)] in by_name:
                        state["state"][k] = by_name[names[id(p)]]
                    else:
                        state["state"].pop(k, None)
        return state

    def load_optimizer_states(self, states: list) -> None:
        """Hand the mirrors their parameters' entries of checkpointed optimizer states."""
        for (i, path), _ in self.groups.items():
            if i >= len(states):
                continue
            order = [p for g in self.optimizers[i].param_groups for p in g["params"]]
            names = {id(p): n for n, p in self.modules[path].named_parameters()}
            saved = states[i].get("state", {})
            by_name = {names[id(p)]: saved[k] for k, p in enumerate(order)
                       if id(p) in names and k in saved}
            self.links[path].load_optimizer(i, by_name)

    def where(self) -> dict[str, dict[int, int]]:
        return self.step.where()

    def close(self, pull: bool = True) -> None:
        """Bring the weights here up to date (unless the worker is lost), give the module
        its own forward back, and end the session."""
        try:
            if pull:
                self.sync()
        finally:
            for link in self.links.values():
                link.uninstall()
            for target in self._patched:
                target.__dict__.pop("zero_grad", None)
            self.step.close()

    def _index(self, optimizer: Any) -> int | None:
        raw = getattr(optimizer, "_optimizer", optimizer)
        return next((i for i, o in enumerate(self.optimizers) if o is raw), None)


def _resolve(model: torch.nn.Module, place: Mapping[str, str]) -> dict[str, torch.nn.Module]:
    names = [n for n, _ in model.named_modules() if n]
    out = {}
    for path, host in place.items():
        if not isinstance(host, str) or not host:
            raise Refused(f"place[{path!r}] = {host!r}: name the worker it runs on, e.g. "
                          f"place={{{path!r}: 'worker'}}")
        try:
            m = model.get_submodule(path) if path else model
        except AttributeError:
            near = difflib.get_close_matches(path, names, n=5) or names[:8]
            raise Refused(
                f"place names {path!r}, which is not a submodule of {type(model).__name__}; "
                f"its submodules include {near}. Give paths as get_submodule takes them "
                "('encoder', 'model.transformer')") from None
        if m is model:
            raise Refused("place names the LightningModule itself: place one of its submodules "
                          f"(e.g. {names[:3]}); its training_step and loss stay here")
        out[path] = m
    for a in out:
        for b in out:
            if a != b and b.startswith(a + "."):
                raise Refused(f"place names {a!r} and {b!r}, which is inside it: place one")
    return out


def _refuse_tied(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module]) -> None:
    owner = {id(p): path for path, m in modules.items() for p in m.parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        path = owner.get(id(p))
        if path is not None and not (name == path or name.startswith(path + ".")):
            raise Refused(
                f"parameter {name!r} is the same tensor as one inside {path!r}, which is "
                "placed on a worker: a weight tied across the cut would be trained in two "
                f"places. Untie it, or place a module that holds both ({name!r} and {path!r})")
