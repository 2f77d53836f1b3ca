"""The placed route: submodules of an unmodified LightningModule placed on workers by
name, ``SomatizeStrategy(place={"encoder": "worker"})``. The model's author changes
nothing and imports nothing from somatize.

Each placed module runs (and trains) over there (``somatize.torch.placed``'s ``Link``);
here it stays in place, so state dicts and checkpoints keep its own keys. Lightning's
optimizers keep its parameters (``.grad`` None here, so they skip them: indices, param
groups and schedulers see what they would in one piece); each optimizer is mirrored
over there, group by group, and its mirror steps when it steps, with the groups'
hyper-parameters as they are then. ``trains={path: Split(Adam, lr=...)}`` (or an
optimizer factory) chooses the optimizer over there for that module instead. The copy
here is brought up to date at epoch ends, before validation and checkpoints, at
teardown, and on ``trainer.strategy.sync()``.

    route = PlacedRoute.open(strategy, trainer, {"encoder": Split(Adam, lr=1e-3)}, session)
    route.optimizer_stepped(optimizer); route.bring_weights_here(); route.close(pull=True)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from .._errors import Refused
from .._graph import Graph, Placement
from ..torch._mirror import Mirror
from ..torch._session import Session
from ..torch.placed._here import Link
from ..torch.placed._there import Placed
from ._derived import DerivedRNG, derived_draws
from ._placing import placed_modules, refuse_tied
from ._private import lightning_optimizers
from ._route import Route

log = logging.getLogger(__name__)

_NOT_PER_PARAMETER = ("LBFGS", "ZeroRedundancyOptimizer")  # a closure, or sharded state


class PlacedRoute(Route):
    """The placed submodules of one LightningModule, their workers and their mirrors:
    the part ``""`` of the fit's session. Once closed, it asks nothing of the workers.

    Args:
        model: the LightningModule.
        place: ``{submodule path: worker name}`` (paths as ``get_submodule`` takes them).
        optimizers: Lightning's optimizers (they keep the placed parameters).
        session: the fit's ``Session``.
        lightning_optimizers: Lightning's wrappers of ``optimizers`` (their zero_grad).
        precision: Lightning's precision plugin (its loss scaler, unscaled over there).
        here: the device the rest of the model computes on.
        trains: ``{path: optimizer factory}`` chosen for a placed module over there.
        schedulers: the lr schedulers (a chosen optimizer's are refused).
    """

    def __init__(self, model: torch.nn.Module, place: Mapping[str, str],
                 optimizers: list, session: Session, lightning_optimizers: list = (),
                 precision: Any = None, here: Any = None,
                 trains: Mapping[str, Any] | None = None, schedulers: list = ()):
        self.modules = placed_modules(model, place)
        self.place = dict(place)
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
        self.closed = False  # the fit is over: its modules have their own forward back
        self.interrupted = False  # Ctrl-C: nothing more is asked of the workers
        self.fitting = False  # a fit, not a validate or test (set by open)
        self.draws: DerivedRNG | None = None  # the calls' seeds, when no RNG state is sent
        self.callbacks: list = []
        self.mirror.patch_zero_grads(list(lightning_optimizers))
        if precision is not None:
            self.mirror.patch_precision(precision)
        for link in self.links.values():
            link.install()
    @override
    @classmethod
    def names(cls, strategy: Any, model: Any) -> list[str]:
        return list(strategy.place)

    @override
    @classmethod
    def open(cls, strategy: Any, trainer: Any, trains: Mapping[str, Any],
             session: Session) -> PlacedRoute | None:
        if not strategy.place:
            return None
        if trains and trainer.training and (
                trainer.gradient_clip_val or getattr(strategy.precision_plugin, "scaler", None)):
            raise Refused(
                "SomatizeStrategy(place=..., trains=...) with gradient clipping or a loss "
                "scaler: the optimizer you chose over there sees neither the norm nor the "
                "scale. Drop trains= (mirrors of your optimizers clip and unscale as one piece "
                "would), or train without them")
        route = cls(strategy.lightning_module, strategy.place, strategy.optimizers,
                    session, lightning_optimizers(strategy),
                    strategy.precision_plugin, strategy.root_device, trains=trains,
                    schedulers=[c.scheduler for c in strategy.lr_scheduler_configs])
        route.fitting = trainer.training  # validate or test: the optimizers here keep theirs
        route.draws = derived_draws(strategy.workers, strategy.place,  # rng="derived"
                                    strategy.rng, strategy.rng_key)
        if route.draws is not None:
            for path in route.draws.keys:
                route.links[path].draws = functools.partial(route.draws.seed, path)
            route.callbacks = trainer.callbacks
            trainer.callbacks.insert(0, route.draws)  # before any other counts a call
        if trainer.training:
            route.say()
        for link in route.links.values():
            link.fitting = trainer.training
        return route

    def say(self) -> None:
        """Log what runs where, as a fit begins (a test or validate after it does not
        say it again)."""
        log.info("placed modules %s run on workers: Lightning's ModelSummary counts their "
                 "FLOPs as 0 (their parameters it counts)", sorted(self.modules))
        for path, m in self.modules.items():
            n = sum(p.numel() for p in m.parameters())
            if self.mirror.trained(path):
                log.info("module %r (%s, %d parameters) runs and trains on worker %r; its "
                         "weights here are brought up to date at epoch ends, checkpoints and "
                         "sync()", path, type(m).__name__, n, self.place[path])
            else:
                log.info("module %r (%s, %d parameters) runs on worker %r and does not "
                         "train there: no optimizer here holds a parameter of it that "
                         "requires grad",
                         path, type(m).__name__, n, self.place[path])
        if self.draws is not None:
            log.info("placed modules %s draw their randomness over there from a generator "
                     "derived per call (rng='derived'): no RNG state of this process is "
                     "sent", sorted(self.draws.keys))

    @override
    def part_of(self, name: str) -> str | None:
        return "" if name in self.modules else None

    @property
    @override
    def trains(self) -> bool:
        return True  # what trains over there is known only as optimizers step

    @override
    def before_step(self) -> None:
        if not self.closed:  # an in-place compile() since the last step: refused now
            for link in self.links.values():
                link.routing.check()

    @override
    def optimizer_stepped(self, optimizer: Any) -> None:
        if not self.closed:  # its mirrors step over there (sent with the next call)
            self.mirror.stepped(optimizer)

    @override
    def bring_weights_here(self) -> None:
        if not self.closed:  # after fit: brought here, with the optimizers' states, at close
            self.sync()

    def sync(self) -> dict[tuple[int, str], dict]:
        """Bring the weights here up to date; return the mirrors' states by
        ``(optimizer index, path)``, each by parameter name."""
        states = {}
        for path, link in self.links.items():
            for i, by_name in link.pull().items():
                states[(i, path)] = by_name
        return states

    @override
    def state_out(self, checkpoint: dict[str, Any]) -> None:
        if not self.closed and self.mirror.chosen:  # the chosen optimizers' states there
            checkpoint.setdefault("somatize", {})["chosen"] = self.mirror.chosen_states()

    @override
    def state_in(self, checkpoint: Mapping[str, Any]) -> None:
        if self.closed:
            return
        # the mirrors get their parameters' entries of the checkpointed optimizer states
        self.mirror.load(list(checkpoint.get("optimizer_states", [])))
        self.mirror.load_chosen_states(dict(checkpoint.get("somatize", {}).get("chosen", {})))

    @override
    def optimizer_state(self, optimizer: Any, state: dict) -> dict:
        # the placed parameters' entries from over there, under the indices one piece
        # would give them; after fit the optimizers here hold what the mirrors held
        i = None if self.closed else self.mirror.index(optimizer)
        return state if i is None else self.mirror.merged(i, state, self.sync())

    @override
    def settle(self) -> None:
        if not self.closed and not self.interrupted:  # (after a Ctrl-C: their worker is stopped)
            for link in self.links.values():
                link.settle()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt) and not self.closed:
            self.interrupted = True  # teardown asks nothing of the workers; says what is lost
            trained = [p for p in self.modules if self.mirror.trained(p)]
            if trained:
                log.warning("interrupted (Ctrl-C): what %s trained on the workers since the "
                            "last epoch end, validation or checkpoint is not brought here: the "
                            "weights here, the optimizers' states and a checkpoint written now "
                            "are those of the last sync. Resume from the last checkpoint",
                            trained)

    @override
    def close(self, pull: bool) -> None:
        """Bring the weights here up to date and the mirrors' states into the optimizers
        here (``pull``, unless interrupted), give the modules their own forward back, and
        end the part of the session."""
        if self.closed:
            return
        self.closed = True
        try:
            if pull and not self.interrupted:
                states = self.sync()
                if self.fitting:  # after fit: the optimizers here are one piece's
                    self.mirror.keep_here(states)
        finally:
            if self.draws is not None and self.draws in self.callbacks:
                self.callbacks.remove(self.draws)
            for link in self.links.values():
                link.uninstall()
            self.mirror.restore()
            self.part.close()
