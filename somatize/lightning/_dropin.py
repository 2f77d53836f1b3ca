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

    place = DropIn(model, {"encoder": "worker"}, optimizers, Session(workers=None))
    place.stepped(optimizer); place.sync(); place.close()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from .._errors import Refused
from .._graph import Graph, Placement
from ..torch._mirror import Mirror
from ..torch._session import Session
from ..torch.placed._here import Link
from ..torch.placed._there import Placed
from ._placing import placed_modules, refuse_tied

log = logging.getLogger(__name__)

_NOT_PER_PARAMETER = ("LBFGS", "ZeroRedundancyOptimizer")  # a closure, or sharded state


class DropIn:
    """The placed submodules of one LightningModule, their workers and their mirrors.

    Args:
        model: the LightningModule.
        place: ``{submodule path: worker name}`` (paths as ``get_submodule`` takes them).
        optimizers: Lightning's optimizers (they keep the placed parameters).
        session: the fit's ``Session``: the placed modules are its part ``""``.
    """

    def __init__(self, model: torch.nn.Module, place: Mapping[str, str],
                 optimizers: list, session: Session, lightning_optimizers: list = (),
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
        self.part = session.open("", graph)
        self.links = {p: Link(self.part, p, m, place[p], here)
                      for p, m in self.modules.items()}
        # the optimizers over there, and what keeps them in step with the ones here
        self.mirror = Mirror(self.modules, self.links, self.optimizers, trains, schedulers)
        self.interrupted = False  # Ctrl-C: nothing more is asked of the workers
        self.trains = False  # set by fitting()
        self.mirror.patch_zero_grads(list(lightning_optimizers))
        if precision is not None:
            self.mirror.patch_precision(precision)
        for link in self.links.values():
            link.install()
        log.info("placed modules %s run on workers: Lightning's ModelSummary counts their "
                 "FLOPs as 0 (their parameters it counts)", sorted(self.modules))
        for path, m in self.modules.items():
            n = sum(p.numel() for p in m.parameters())
            if self.mirror.trained(path):
                log.info("module %r (%s, %d parameters) runs and trains on worker %r; its "
                         "weights here are brought up to date at epoch ends, checkpoints and "
                         "sync()", path, type(m).__name__, n, place[path])
            else:
                log.info("module %r (%s, %d parameters) runs on worker %r and does not "
                         "train there: no optimizer here holds a parameter of it that "
                         "requires grad",
                         path, type(m).__name__, n, place[path])

    @property
    def chosen(self) -> dict[str, list[int]]:
        """The placed paths trained by the user's own optimizer over there (``trains=``)."""
        return self.mirror.chosen

    def chosen_states(self) -> dict[str, Any]:
        """The chosen optimizers' states over there, by placed path."""
        return self.mirror.chosen_states()

    def load_chosen_states(self, states: Mapping[str, Any]) -> None:
        self.mirror.load_chosen_states(dict(states))

    # -- what the strategy tells it ----------------------------------------------------
    def check(self) -> None:
        """Refuse what took a placed module's calls away (an in-place compile())."""
        for link in self.links.values():
            link.check()

    def fitting(self, on: bool) -> None:
        self.trains = on  # validate or test after fit: the optimizers here keep their state
        for link in self.links.values():
            link.fitting = on

    def stepped(self, optimizer: Any) -> None:
        """``optimizer`` stepped here: its mirrors step over there (sent with the next call)."""
        self.mirror.stepped(optimizer)

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
        i = self.mirror.index(optimizer)
        return state if i is None else self.mirror.merged(i, state, self.sync())

    def load_optimizer_states(self, states: list) -> None:
        """Hand the mirrors their parameters' entries of checkpointed optimizer states."""
        self.mirror.load(states)

    def where(self) -> dict[str, dict[int, int]]:
        """Which processes ran each placed module, and how often: ``{path: {pid: times}}``."""
        return self.part.where()

    def interrupt(self) -> None:
        """Ctrl-C: ask nothing more of the workers (the session stops them), and say what
        is not saved."""
        self.interrupted = True
        trained = [p for p in self.modules if self.mirror.trained(p)]
        if trained:
            log.warning("interrupted (Ctrl-C): what %s trained on the workers since the last "
                        "epoch end, validation or checkpoint is not brought here: the weights "
                        "here, the optimizers' states and a checkpoint written now are those "
                        "of the last sync. Resume from the last checkpoint", trained)

    def settle(self) -> None:
        """Wait for the backwards still in flight over there."""
        if self.interrupted:
            return  # their worker was stopped
        for link in self.links.values():
            link.settle()

    def close(self, pull: bool = True) -> None:
        """Bring the weights here up to date and the mirrors' states into the optimizers
        here (unless the worker is lost), give the module its own forward back, and end
        its part of the session."""
        try:
            if pull and not self.interrupted:
                states = self.sync()
                if self.trains:  # after fit: the optimizers here are one piece's
                    self.mirror.keep_here(states)
        finally:
            for link in self.links.values():
                link.uninstall()
            self.mirror.restore()
            self.part.close()
