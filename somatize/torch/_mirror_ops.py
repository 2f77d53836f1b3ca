"""The optimizer operations a ``Mirror`` (``_mirror.py``) sends to where a module it
mirrors runs, each a typed value that does its own work there (``op.apply(placed)``), the
functions the worker runs for it (build a mirror, norms, unscale, state in and out), and
how a mirror is rebuilt from the optimizer here and checked against it. ``placed`` is
what stands for the module over there, on either route: ``.module`` (its parameters by
name), ``.mirrors`` (by index of the optimizer here) and ``.chosen`` (the user's own).

    ops = [Zero(0, True), StepMirror(0, [{"lr": 0.1, ...}])]   # queued here
    for op in ops: op.apply(placed)                     # over there, before the next call
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._errors import Refused
from .._trace import span
from . import _private
from ._state import on_cpu as _on_cpu
from .placed._there import _apply, _settled_on

# -- over there: what each queued operation does to the worker's placed module -----------


def _params(opt: torch.optim.Optimizer) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def _grads(opt: torch.optim.Optimizer) -> list:
    return [p.grad for p in _params(opt) if p.grad is not None]


@dataclass(frozen=True)
class StepMirror:
    """Mirror ``index`` steps, its groups' hyper-parameters set first (a scheduler's lr)."""
    index: int
    groups: list
    moves_weights: ClassVar[bool] = True

    def apply(self, placed: Any) -> None:
        opt = placed.mirrors[self.index]
        for group, hyper in zip(opt.param_groups, self.groups, strict=True):
            group.update(hyper)
        with span(f"optimizer step {self.index}", "step"):
            opt.step()


@dataclass(frozen=True)
class StepChosen:
    """The optimizer the user chose for the module over there steps."""
    moves_weights: ClassVar[bool] = True

    def apply(self, placed: Any) -> None:
        with span("optimizer step (chosen)", "step"):
            placed.chosen.step()


@dataclass(frozen=True)
class Zero:
    """Mirror ``index`` clears its gradients, as the optimizer here just did."""
    index: int
    set_to_none: bool

    def apply(self, placed: Any) -> None:
        placed.mirrors[self.index].zero_grad(set_to_none=self.set_to_none)


@dataclass(frozen=True)
class ZeroChosen:
    """The chosen optimizer clears its gradients."""
    set_to_none: bool

    def apply(self, placed: Any) -> None:
        placed.chosen.zero_grad(set_to_none=self.set_to_none)


@dataclass(frozen=True)
class AddGroup:
    """A group added here during fit (a finetuning callback): added to mirror ``index``."""
    index: int
    names: list
    hyper: dict

    def apply(self, placed: Any) -> None:
        params = dict(placed.module.named_parameters())
        placed.mirrors[self.index].add_param_group(
            {**self.hyper, "params": [params[n] for n in self.names]})


@dataclass(frozen=True)
class ClipMul:
    """Mirror ``index``'s gradients times the coefficient one piece's norm clipping found."""
    index: int
    coef: torch.Tensor

    def apply(self, placed: Any) -> None:
        grads = _grads(placed.mirrors[self.index])
        if grads:
            _private.foreach_mul_(grads, self.coef.to(grads[0].device))


@dataclass(frozen=True)
class ClipValue:
    """Mirror ``index``'s gradients clipped by value."""
    index: int
    value: float

    def apply(self, placed: Any) -> None:
        torch.nn.utils.clip_grad_value_(_params(placed.mirrors[self.index]),
                                        clip_value=self.value)


@dataclass(frozen=True)
class Built:
    """What a mirror became over there: compared with the optimizer here."""
    defaults: dict
    groups: list
    settings: dict
    error: str | None = None


def _ready(live, name: str, ops: list) -> Any:
    # the placed module over there, with what was queued for it done first
    placed = live.catalog[name]
    _apply(placed, ops)
    return placed


def _settings(opt: torch.optim.Optimizer) -> dict:
    # plain values an optimizer keeps on itself besides its groups (what defaults miss)
    skip = {"state", "param_groups", "defaults"}
    return {k: v for k, v in vars(opt).items() if k not in skip and not k.startswith("_")
            and isinstance(v, (bool, int, float, str, type(None)))}


def _build(live, name: str, i: int, groups: list, ops: list, *, cls: type, kwargs: dict,
           device: str | None = "cpu") -> Built:
    placed = _ready(live, name, ops)
    if device is not None:  # None: the module computes where its weights already are
        _settled_on(placed, device)
    params = dict(placed.module.named_parameters())
    try:
        opt = cls([{**hyper, "params": [params[n] for n in names]} for names, hyper in groups],
                  **kwargs)
        for group, (_, hyper) in zip(opt.param_groups, groups, strict=True):
            group.update(hyper)  # the group's full hyper-parameters, as they are here
    except Exception as e:  # said here, as a refusal naming the optimizer
        return Built({}, [], {}, f"{type(e).__name__}: {e}")
    placed.mirrors[i] = opt
    return Built(_plain(opt.defaults), [_plain(_hyper(g)) for g in opt.param_groups],
                 _settings(opt))


def _choose(live, name: str, ops: list, *, factory: Any) -> None:
    placed = _ready(live, name, ops)
    placed.chosen = factory([p for p in placed.module.parameters() if p.requires_grad])


def _chosen_state(live, name: str, ops: list) -> dict:
    placed = _ready(live, name, ops)
    return _on_cpu(placed.chosen.state_dict())


def _load_chosen(live, name: str, state: dict, ops: list) -> None:
    _ready(live, name, ops).chosen.load_state_dict(state)


def _norms(live, name: str, i: int, norm_type: float, ops: list) -> dict:
    placed = _ready(live, name, ops)
    names = {id(p): n for n, p in placed.module.named_parameters()}
    return {names[id(p)]: _private.foreach_norm([p.grad], norm_type)[0].cpu()
            for p in _params(placed.mirrors[i]) if p.grad is not None}


def _unscale(live, name: str, i: int, inv: torch.Tensor, ops: list) -> torch.Tensor:
    placed = _ready(live, name, ops)
    grads = _grads(placed.mirrors[i])
    dev = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, device=dev)
    if grads:  # what GradScaler.unscale_ does to each gradient, in place
        _private.unscale_(grads, found, inv.to(dev))
    return found.cpu()


def mirror_states(placed: Any) -> dict:
    """The mirrors' states over there, on the CPU: ``{index here: {parameter name: entry}}``."""
    names = {id(p): n for n, p in placed.module.named_parameters()}
    return {i: {names[id(p)]: _on_cpu(st) for p, st in opt.state.items()}
            for i, opt in placed.mirrors.items()}


def _mirror_states(live, name: str, ops: list) -> dict:
    return mirror_states(_ready(live, name, ops))


def _queued(live, name: str, ops: list) -> None:
    """What was queued for ``name`` over there, done now (sent ahead of a forward)."""
    _ready(live, name, ops)


def _load_optimizer(live, name: str, i: int, by_name: dict, ops: list) -> None:
    placed = _ready(live, name, ops)  # the groups added over there before their state
    opt = placed.mirrors[i]
    names = {id(p): n for n, p in placed.module.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    sd = opt.state_dict()
    sd["state"] = {k: by_name[n] for k, n in enumerate(order) if n in by_name}
    opt.load_state_dict(sd)


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _plain(d: dict) -> dict:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


# -- here: how a mirror is rebuilt, and checked ------------------------------------------

def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return a is b


def _differs(here: dict, there: dict) -> str | None:
    for k in sorted(set(here) | set(there), key=str):
        if k not in there:
            return f"{k!r} is {here[k]!r} here and missing over there"
        if k not in here:
            return f"{k!r} is {there[k]!r} over there and missing here"
        if not _same(here[k], there[k]):
            return f"{k!r} is {here[k]!r} here and {there[k]!r} over there"
    return None


def constructor_args(optimizer: torch.optim.Optimizer, path: str) -> dict:
    """The arguments that rebuild ``optimizer``: those its constructor takes that it keeps
    in ``defaults``. Refused when the constructor needs one ``defaults`` lacks."""
    cls = type(optimizer)
    try:
        sig = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        sig = {}
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in sig and k != "params"}
    needed = [k for k, p in list(sig.items())[1:] if k != "params" and k not in kwargs
              and p.default is p.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if needed:
        raise _cannot(optimizer, path, f"its constructor needs {needed}, which it does not "
                                       "keep in its defaults")
    return kwargs


def check(optimizer: torch.optim.Optimizer, group_indices: list, path: str,
          built: Built) -> None:
    """Refuse unless the mirror over there equals ``optimizer`` here: defaults, the
    groups' hyper-parameters and plain settings."""
    if built.error is not None:
        raise _cannot(optimizer, path, f"building it over there raised {built.error}")
    why = _differs(_plain(optimizer.defaults), built.defaults)
    if why is None:
        for g, there in zip(group_indices, built.groups, strict=True):
            why = _differs(_plain(_hyper(optimizer.param_groups[g])), there)
            if why is not None:
                why = f"in param group {g}, {why}"
                break
    if why is None:
        why = _differs(_settings(optimizer), built.settings)
    if why is not None:
        raise _cannot(optimizer, path, f"rebuilt over there from its constructor arguments, "
                                       f"it differs: {why}")


def _cannot(optimizer: Any, path: str, why: str) -> Refused:
    name = type(optimizer).__qualname__
    return Refused(
        f"{name} holds parameters of {path!r}, which is placed on a worker, and it cannot "
        f"be rebuilt there as it is here: {why}. An optimizer is rebuilt from the "
        "constructor arguments it keeps in its defaults (as torch.optim's do): keep every "
        f"argument of {name} in defaults, or train {path!r} over there with an optimizer "
        f"of your choice: trains={{{path!r}: Split(torch.optim.AdamW, lr=...)}} (given to "
        "SomatizeStrategy or Trainer)")
