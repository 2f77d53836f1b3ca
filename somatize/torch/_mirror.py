"""The optimizers over there that follow the ones here, for both routes: a placed
module (``place=``) and a graph's node placed with ``.at(...)`` that the optimizer here
holds are trained where they run by mirrors of it. One ``Mirror`` owns them (which groups
of which optimizer hold whose parameters, zero_grad, steps, the loss scaler, clipping,
state out and in). What it queues are typed operations (``_mirror_ops.py``), each doing
its own work over there (``op.apply(placed)``) on the object that stands for the module
there (``.module``, ``.mirrors``, ``.chosen``): the placed route's ``Placed``, the graph
route's ``Mirrored`` trainer.

Each mirror is built over there from the same constructor arguments as the optimizer
here (those its constructor takes that it keeps in ``defaults``), and then checked:
its ``defaults``, every group's hyper-parameters and its plain settings must equal the
optimizer's here, or the run is refused before the first batch. It steps when that
optimizer steps, with its groups' hyper-parameters as they are then (a scheduler's lr).

    mirror = Mirror(modules, links, optimizers)   # builds the mirrors over there
    mirror.stepped(optimizer)                     # a StepMirror queued, sent with the next call

A link is what sends to where one module runs: ``queue(op)`` (sent, in order, before
its next forward or call), ``call(fn, *args)`` (``fn(live, name, *args, ops)`` over
there, what is queued done first) and ``device`` (where the module computes over there;
None: where its weights already are).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._errors import Refused
from . import _private
from ._mirror_ops import (
    AddGroup,
    ClipMul,
    ClipValue,
    StepChosen,
    StepMirror,
    Zero,
    ZeroChosen,
    _build,
    _choose,
    _chosen_state,
    _hyper,
    _load_chosen,
    _load_optimizer,
    _norms,
    _unscale,
    check,
    constructor_args,
)

_UNSET = object()  # an attribute the instance did not have of its own

__all__ = ["AddGroup", "ClipMul", "ClipValue", "Mirror", "StepChosen", "StepMirror", "Zero",
           "ZeroChosen"]

# -- here: the one object that owns the mirrors ------------------------------------------

class Mirror:
    """The optimizers here mirrored over the placed modules' parameters, and everything
    that keeps the mirrors in step: groups added during fit, zero_grad, steps, the loss
    scaler, clipping, state out and in, the states kept here once the route closes.

    Args:
        modules: ``{path: placed module}``.
        links: ``{path: Link}`` (what sends to each module's worker).
        optimizers: the optimizers here (they keep the placed parameters).
        trains: ``{path: Split or factory}``: the user's own optimizer over there.
        schedulers: the schedulers here (a chosen optimizer cannot follow one).
    """

    def __init__(self, modules: dict, links: dict, optimizers: list,
                 trains: dict | None = None, schedulers: list = ()):
        self.modules, self.links, self.optimizers = modules, links, list(optimizers)
        # per (optimizer index, path): the optimizer's groups holding placed parameters,
        # with those parameters' names inside the module
        self.groups: dict[tuple[int, str], list] = {}
        self.chosen: dict[str, list[int]] = {}  # path -> the optimizers here its trainer follows
        for path, trainer in (trains or {}).items():
            self._choose(path, trainer, schedulers)
        self._seen = [0] * len(self.optimizers)  # per optimizer here: its groups mirrored
        for i in range(len(self.optimizers)):
            self.follow(i)
        self.skipped: set[int] = set()  # optimizers whose step the loss scaler skipped
        self._patched: list = []  # (object, attribute, what it was, ours) set here
        self.wrappers: dict[int, list] = {}  # per optimizer here: what wraps it for the user
        self._plugin: Any = None

    def trained(self, path: str) -> bool:
        """Whether ``path`` trains over there (by a mirror or the user's own optimizer)."""
        if not any(p.requires_grad for p in self.modules[path].parameters()):
            return False
        return path in self.chosen or any(p == path for _, p in self.groups)

    def _choose(self, path: str, trainer: Any, schedulers: list) -> None:
        # the user's own optimizer for a placed module (trains={path: Split(Adam, lr=...)}):
        # built over there, stepping and zeroing when the optimizers here that hold the
        # module's parameters do (every optimizer, when none holds them)
        from .graph._split import Split

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
        self.links[path].call(functools.partial(_choose, factory=factory))  # by value if need be

    def follow(self, i: int) -> None:
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
            link = self.links[path]
            if (i, path) in self.groups:
                for g, names_in in groups:
                    link.queue(AddGroup(i, names_in, _hyper(opt.param_groups[g])))
                self.groups[(i, path)] += groups
                continue
            kwargs = constructor_args(opt, path)
            sent = [(ns, _hyper(opt.param_groups[g])) for g, ns in groups]
            # the class travels by value where it must (cloudpickle pickles the call)
            built = link.call(functools.partial(_build, cls=type(opt), kwargs=kwargs,
                                                device=link.device), i, sent)
            check(opt, [g for g, _ in groups], path, built)
            self.groups[(i, path)] = groups
        self._seen[i] = len(opt.param_groups)

    # -- zero_grad, the loss scaler, clipping: as one piece, on every side ---------------
    def patch_zero_grads(self, wrappers: list = ()) -> None:
        """zero_grad reaches the mirrors: with two optimizers stepped at different rates, a
        gradient left over there must be cleared when the user clears it here.
        ``wrappers``: what hands the optimizers to the user's code (Lightning's
        ``LightningOptimizer``, whose public ``.optimizer`` is the one here)."""
        for i, opt in enumerate(self.optimizers):
            self.wrappers[i] = [w for w in wrappers if w.optimizer is opt]
            for target in [opt, *self.wrappers[i]]:
                original = target.zero_grad

                def zero_grad(set_to_none: bool = True, _i=i, _original=original):
                    _original(set_to_none=set_to_none)
                    if self._patched:  # (not once taken back, under a later wrapper)
                        self.zeroed(_i, set_to_none)

                self._patch(target, "zero_grad", zero_grad)

    def zeroed(self, i: int, set_to_none: bool = True) -> None:
        """Optimizer ``i`` here cleared its gradients: so do its mirrors (sent with the
        next call), and the optimizers chosen over there that follow it."""
        self.follow(i)
        for p in self.trained_by(i):
            self.links[p].queue(ZeroChosen(set_to_none) if p in self.chosen
                                else Zero(i, set_to_none))

    def _patch(self, target: Any, attr: str, value: Any) -> None:
        # set on the instance here only; restore() takes it back
        self._patched.append((target, attr, target.__dict__.get(attr, _UNSET), value))
        setattr(target, attr, value)

    def patch_precision(self, precision: Any) -> None:
        """Clipping and the loss scaler see every parameter, here and over there, as one
        piece would: the precision plugin's own methods, wrapped on this object only."""
        self._plugin = precision
        clip_norm, clip_value = precision.clip_grad_by_norm, precision.clip_grad_by_value

        def clip_grad_by_norm(optimizer, clip_val):
            if not (self._patched and self._clip_norm(optimizer, clip_val)):
                clip_norm(optimizer, clip_val)

        def clip_grad_by_value(optimizer, clip_val):
            clip_value(optimizer, clip_val)
            for path in self._paths(optimizer) if self._patched else ():
                self.links[path].queue(ClipValue(self.index(optimizer), clip_val))

        self._patch(precision, "clip_grad_by_norm", clip_grad_by_norm)
        self._patch(precision, "clip_grad_by_value", clip_grad_by_value)
        scaler = getattr(precision, "scaler", None)
        if scaler is None:
            return
        unscale, step = scaler.unscale_, scaler.step

        def unscale_(optimizer):
            unscale(optimizer)
            found = _private.scaler_found_inf(scaler, optimizer)["found_inf_per_device"]
            inv = _private.scaler_scale(scaler).double().reciprocal().float()  # as GradScaler
            for path in self._paths(optimizer) if self._patched else ():
                inf = self.links[path].call(_unscale, self.index(optimizer), inv)
                key = next(iter(found), inf.device)
                found[key] = found[key] + inf.to(key) if key in found else inf

        def step_(optimizer, *args, **kwargs):
            infs = _private.scaler_found_inf_if_any(scaler, optimizer).get(
                "found_inf_per_device", {})
            i = self.index(optimizer)
            if i is not None and self._patched and sum(v.item() for v in infs.values()):
                self.skipped.add(i)  # inf or nan somewhere: no side steps
            return step(optimizer, *args, **kwargs)

        self._patch(scaler, "unscale_", unscale_)
        self._patch(scaler, "step", step_)

    def _clip_norm(self, optimizer: Any, clip_val: float, norm_type: float = 2.0) -> bool:
        """clip_grad_norm_ over the parameters here and over there, as one piece: the
        same per-parameter norms, stacked in the order one piece stacks them (grouped
        by device and dtype, first seen first), the same coefficient on every side."""
        i = self.index(optimizer)
        paths = self._paths(optimizer)
        if i is None or not paths:
            return False
        params = self._plugin.main_params(optimizer)
        far: dict[int, torch.Tensor] = {}
        for path in paths:
            names = {n: p for n, p in self.modules[path].named_parameters()}
            for n, norm in self.links[path].call(_norms, i, norm_type).items():
                far[id(names[n])] = norm
        groups: dict[tuple, list] = {}
        here = []
        for p in params:
            if id(p) in far:
                groups.setdefault((p.device, p.dtype), []).append(far[id(p)])
            elif p.grad is not None:
                norm = _private.foreach_norm([p.grad], norm_type)[0]
                groups.setdefault((p.grad.device, p.grad.dtype), []).append(norm)
                here.append(p.grad)
        norms = [n for ns in groups.values() for n in ns]
        if not norms:
            return True
        first = next(iter(groups))[0]
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        if here:
            _private.foreach_mul_(here, coef)
        for path in paths:
            self.links[path].queue(ClipMul(i, coef))
        return True

    def _paths(self, optimizer: Any) -> list[str]:
        i = self.index(optimizer)
        if i is not None:
            self.follow(i)  # a group added since the last zero_grad is clipped too
        return [p for (j, p) in self.groups if j == i]

    # -- steps, and state out and in -----------------------------------------------------
    def stepped(self, optimizer: Any) -> None:
        """``optimizer`` stepped here: its mirrors step over there (sent with the next
        call), with their groups' hyper-parameters as they are now (a scheduler's lr)."""
        i = self.index(optimizer)
        if i is None:
            return
        if i in self.skipped:  # the loss scaler found inf or nan: nobody steps
            self.skipped.discard(i)
            return
        self.follow(i)
        opt = self.optimizers[i]
        for (j, path), groups in self.groups.items():
            if j == i:
                hypers = [_hyper(opt.param_groups[g]) for g, _ in groups]
                self.links[path].queue(StepMirror(i, hypers))
        for path, led in self.chosen.items():
            if i in led:
                self.links[path].queue(StepChosen())

    def merged(self, i: int, state: dict, mirrors: dict) -> dict:
        """``state`` (optimizer ``i`` here's) with the placed parameters' entries from
        ``mirrors`` (``{(i, path): {name: entry}}``), under the indices one piece gives."""
        self.follow(i)
        order = [p for g in self.optimizers[i].param_groups for p in g["params"]]
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
        return dict(state, state=dict(sorted(state["state"].items())))

    def keep_here(self, mirrors: dict) -> None:
        """The route closes: the mirrors' states become the optimizers' here, so that
        after fit ``optimizer.state_dict()`` (and a checkpoint) is what one piece has."""
        for i, opt in enumerate(self.optimizers):
            if any(j == i for j, _ in self.groups):
                opt.load_state_dict(self.merged(i, opt.state_dict(), mirrors))

    def load(self, states: list) -> None:
        """Hand the mirrors their parameters' entries of checkpointed optimizer states."""
        for i in range(len(self.optimizers)):  # groups restored before this (finetuning)
            self.follow(i)
        for (i, path), _ in self.groups.items():
            if i >= len(states):
                continue
            order = [p for g in self.optimizers[i].param_groups for p in g["params"]]
            names = {id(p): n for n, p in self.modules[path].named_parameters()}
            saved = states[i].get("state", {})
            by_name = {names[id(p)]: saved[k] for k, p in enumerate(order)
                       if id(p) in names and k in saved}
            self.links[path].call(_load_optimizer, i, by_name)  # queued groups added first

    def chosen_states(self) -> dict[str, Any]:
        """The chosen optimizers' states over there, by placed path."""
        return {p: self.links[p].call(_chosen_state) for p in self.chosen}

    def load_chosen_states(self, states: dict) -> None:
        for p, state in states.items():
            if p in self.chosen:
                self.links[p].call(_load_chosen, state)

    def restore(self) -> None:
        """Take back what was set on instances here (zero_grad, the plugin's methods). One
        that another Mirror wrapped since (the other route's) stays under it, passing
        straight through to what it wrapped."""
        for target, attr, before, mine in reversed(self._patched):
            if target.__dict__.get(attr) is not mine:
                continue
            if before is _UNSET:
                del target.__dict__[attr]
            else:
                target.__dict__[attr] = before
        self._patched.clear()

    def trained_by(self, i: int) -> list[str]:
        """The placed modules optimizer ``i`` here trains (by a mirror or the user's own)."""
        return ([p for (j, p) in self.groups if j == i]
                + [p for p, led in self.chosen.items() if i in led])

    def index(self, optimizer: Any) -> int | None:
        """Which optimizer here ``optimizer`` is (itself, or a wrapper of it), or None."""
        return next((i for i, o in enumerate(self.optimizers)
                     if o is optimizer or any(w is optimizer for w in self.wrappers.get(i, ()))),
                    None)
