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

import logging
from collections.abc import Mapping
from typing import Any

import torch

from .._errors import Refused
from .._graph import Graph, Placement
from ..torch._placed import Link, Placed
from ..torch._session import Session
from ._placing import placed_modules, refuse_tied

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
                 optimizers: list, workers: Any = None, lightning_optimizers: list = (),
                 precision: Any = None, here: Any = None,
                 trains: Mapping[str, Any] | None = None, schedulers: list = ()):
        self.modules = placed_modules(model, place)
        trains = dict(trains or {})
        odd = sorted(set(trains) - set(self.modules))
        if odd:
            raise Refused(
                f"trains names {odd}, which are not placed modules; with place= key trains by "
                f"the placed modules' paths: {sorted(self.modules)}")
        refuse_tied(model, self.modules)
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
        # one node per module, no edges: how each module, as it is now, is sent once
        self.session = Session(graph, workers=workers)
        if self.session.runtime is not None:  # no graph here to close: the fit is what restarts
            self.session.runtime.restart = "run the fit again (it starts fresh workers)"
        self.links = {p: Link(self.session, p, m, place[p], here)
                      for p, m in self.modules.items()}
        # per (optimizer index, path): the optimizer's groups holding placed parameters,
        # with those parameters' names inside the module
        self.groups: dict[tuple[int, str], list] = {}
        self.chosen: dict[str, list[int]] = {}  # path -> the optimizers here its trainer follows
        for path, trainer in trains.items():
            self._choose(path, trainer, schedulers)
        self._seen = [0] * len(self.optimizers)  # per optimizer here: its groups mirrored
        for i in range(len(self.optimizers)):
            self._follow(i)
        self._zero_grads(list(lightning_optimizers))
        self.skipped: set[int] = set()  # optimizers whose step the loss scaler skipped
        if precision is not None:
            self._precision(precision)
        for link in self.links.values():
            link.install()
        for path, m in self.modules.items():
            n = sum(p.numel() for p in m.parameters())
            if self._trained(path):
                log.info("module %r (%s, %d parameters) runs and trains on worker %r; its "
                         "weights here are brought up to date at epoch ends, checkpoints and "
                         "sync()", path, type(m).__name__, n, place[path])
            else:
                log.info("module %r (%s, %d parameters) runs on worker %r and does not "
                         "train there: no optimizer here holds a parameter of it that "
                         "requires grad",
                         path, type(m).__name__, n, place[path])

    def _trained(self, path: str) -> bool:
        if not any(p.requires_grad for p in self.modules[path].parameters()):
            return False
        return path in self.chosen or any(p == path for _, p in self.groups)

    def _choose(self, path: str, trainer: Any, schedulers: list) -> None:
        # the user's own optimizer for a placed module (trains={path: Split(Adam, lr=...)}):
        # built over there, stepping and zeroing when the optimizers here that hold the
        # module's parameters do (every optimizer, when none holds them)
        from ..torch import Split

        factory = trainer.factory if isinstance(trainer, Split) else trainer
        if not callable(factory):
            raise Refused(f"trains[{path!r}] is a {type(trainer).__name__}: give a Split "
                          "(Split(torch.optim.Adam, lr=1e-3)) or an optimizer factory")
        params = {id(p) for p in self.modules[path].parameters()}
        holders = [i for i, o in enumerate(self.optimizers)
                   if any(id(p) in params for g in o.param_groups for p in g["params"])]
        led = [s for s in schedulers if any(s.optimizer is self.optimizers[i] for i in holders)]
        if led:
            raise Refused(
                f"trains[{path!r}] chooses the optimizer over there, but a learning-rate "
                f"scheduler ({type(led[0]).__name__}) drives an optimizer here that also holds "
                f"{path!r}'s parameters: yours would not follow it. Leave {path!r}'s "
                "parameters out of that optimizer, or drop trains= to have mirrors follow it")
        self.chosen[path] = holders or list(range(len(self.optimizers)))
        self.links[path].choose(factory)

    def _follow(self, i: int) -> None:
        """Mirror the groups of optimizer ``i`` not mirrored yet: all of them at the start,
        then those added during fit (``add_param_group``: a finetuning callback unfreezing
        a placed backbone)."""
        opt = self.optimizers[i]
        first = self._seen[i]
        if first == len(opt.param_groups):
            return
        for path, m in self.modules.items():
            if path in self.chosen:
                continue  # trained by the user's choice, not a mirror
            names = {id(p): n for n, p in m.named_parameters()}
            groups = [(gi, [names[id(p)] for p in opt.param_groups[gi]["params"]
                            if id(p) in names])
                      for gi in range(first, len(opt.param_groups))]
            groups = [(gi, ns) for gi, ns in groups if ns]
            if not groups:
                continue
            if (i, path) in self.groups:
                self.links[path].grow(i, opt, groups)
                self.groups[(i, path)] += groups
            else:
                self.links[path].mirror(i, opt, groups)
                self.groups[(i, path)] = groups
        self._seen[i] = len(opt.param_groups)

    def chosen_states(self) -> dict[str, Any]:
        """The chosen optimizers' states over there, by placed path."""
        return {p: self.links[p].chosen_state() for p in self.chosen}

    def load_chosen_states(self, states: Mapping[str, Any]) -> None:
        for p, state in states.items():
            if p in self.chosen:
                self.links[p].load_chosen(state)

    def _zero_grads(self, wrappers: list) -> None:
        # zero_grad reaches the mirrors: with two optimizers stepped at different rates, a
        # gradient left over there must be cleared when the user clears it here
        self._patched = []
        for i, opt in enumerate(self.optimizers):
            for target in [opt, *[w for w in wrappers if getattr(w, "_optimizer", None) is opt]]:
                original = target.zero_grad

                def zero_grad(set_to_none: bool = True, _i=i, _original=original):
                    _original(set_to_none=set_to_none)
                    self._follow(_i)
                    for p in self._trained_by(_i):
                        self.links[p].zeroed(_i, set_to_none)

                target.zero_grad = zero_grad
                self._patched.append(target)

    def _precision(self, precision: Any) -> None:
        # clipping and the loss scaler see every parameter, here and over there, as one
        # piece would: the precision plugin's own methods, wrapped on this object only
        self._plugin = precision
        self._wrapped = [precision]
        clip_norm, clip_value = precision.clip_grad_by_norm, precision.clip_grad_by_value

        def clip_grad_by_norm(optimizer, clip_val):
            if not self._clip_norm(optimizer, clip_val):
                clip_norm(optimizer, clip_val)

        def clip_grad_by_value(optimizer, clip_val):
            clip_value(optimizer, clip_val)
            for path in self._paths(optimizer):
                self.links[path].clip_value(self._index(optimizer), clip_val)

        precision.clip_grad_by_norm = clip_grad_by_norm
        precision.clip_grad_by_value = clip_grad_by_value
        scaler = getattr(precision, "scaler", None)
        if scaler is None:
            return
        self._wrapped.append(scaler)
        unscale, step = scaler.unscale_, scaler.step

        def unscale_(optimizer):
            unscale(optimizer)
            raw = getattr(optimizer, "_optimizer", optimizer)
            state = scaler._per_optimizer_states[id(raw)]  # where GradScaler keeps found_inf
            inv = scaler._scale.double().reciprocal().float()  # as GradScaler computes it
            found = state["found_inf_per_device"]
            for path in self._paths(optimizer):
                inf = self.links[path].unscale(self._index(optimizer), inv)
                key = next(iter(found), inf.device)
                found[key] = found[key] + inf.to(key) if key in found else inf

        def step_(optimizer, *args, **kwargs):
            raw = getattr(optimizer, "_optimizer", optimizer)
            state = scaler._per_optimizer_states.get(id(raw), {})
            infs = state.get("found_inf_per_device", {})
            i = self._index(optimizer)
            if i is not None and sum(v.item() for v in infs.values()):
                self.skipped.add(i)  # inf or nan somewhere: no side steps
            return step(optimizer, *args, **kwargs)

        scaler.unscale_ = unscale_
        scaler.step = step_

    def _clip_norm(self, optimizer: Any, clip_val: float, norm_type: float = 2.0) -> bool:
        """clip_grad_norm_ over the parameters here and over there, as one piece: the
        same per-parameter norms, stacked in the order one piece stacks them (grouped
        by device and dtype, first seen first), the same coefficient on every side."""
        i = self._index(optimizer)
        paths = self._paths(optimizer)
        if i is None or not paths:
            return False
        params = self._plugin.main_params(optimizer)
        far: dict[int, torch.Tensor] = {}
        for path in paths:
            names = {n: p for n, p in self.modules[path].named_parameters()}
            for n, norm in self.links[path].norms(i, norm_type).items():
                far[id(names[n])] = norm
        groups: dict[tuple, list] = {}
        here = []
        for p in params:
            if id(p) in far:
                norm = far[id(p)]
                groups.setdefault((p.device, p.dtype), []).append(norm)
            elif p.grad is not None:
                norm = torch._foreach_norm([p.grad], norm_type)[0]
                groups.setdefault((p.grad.device, p.grad.dtype), []).append(norm)
                here.append(p.grad)
        norms = [n for ns in groups.values() for n in ns]
        if not norms:
            return True
        first = next(iter(groups))[0]
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        if here:
            torch._foreach_mul_(here, coef)
        for path in paths:
            self.links[path].clip_mul(i, coef)
        return True

    def _paths(self, optimizer: Any) -> list[str]:
        i = self._index(optimizer)
        if i is not None:
            self._follow(i)  # a group added since the last zero_grad is clipped too
        return [p for (j, p) in self.groups if j == i]

    # -- what the strategy tells it ----------------------------------------------------
    def fitting(self, on: bool) -> None:
        for link in self.links.values():
            link.fitting = on

    def stepped(self, optimizer: Any) -> None:
        """``optimizer`` stepped here: its mirrors step over there (sent with the next call)."""
        i = self._index(optimizer)
        if i is None:
            return
        if i in self.skipped:  # the loss scaler found inf or nan: nobody steps
            self.skipped.discard(i)
            return
        self._follow(i)
        for (j, path), groups in self.groups.items():
            if j == i:
                self.links[path].stepped(i, self.optimizers[i], groups)
        for path, led in self.chosen.items():
            if i in led:
                self.links[path].ops.append(("step", "chosen", None))

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
        self._follow(i)
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
        for i in range(len(self.optimizers)):  # groups restored before this (finetuning)
            self._follow(i)
        for link in self.links.values():
            link.flush()  # the groups added over there before their state arrives
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
        """Which processes ran each placed module, and how often: ``{path: {pid: times}}``."""
        return self.session.where()

    def settle(self) -> None:
        """Wait for the backwards still in flight over there."""
        for link in self.links.values():
            link.settle()

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
            for target in getattr(self, "_wrapped", []):
                for attr in ("clip_grad_by_norm", "clip_grad_by_value", "unscale_", "step"):
                    target.__dict__.pop(attr, None)
            self.session.close()

    def _trained_by(self, i: int) -> list[str]:
        """The placed modules optimizer ``i`` here trains (by a mirror or the user's own)."""
        return ([p for (j, p) in self.groups if j == i]
                + [p for p, led in self.chosen.items() if i in led])

    def _index(self, optimizer: Any) -> int | None:
        raw = getattr(optimizer, "_optimizer", optimizer)
        return next((i for i, o in enumerate(self.optimizers) if o is raw), None)
