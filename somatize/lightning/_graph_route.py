"""The graph route: GraphModules inside a LightningModule whose nodes are placed with
``.at("worker")``. Each runs as ``somatize.torch``'s ``Step`` (the one ``Trainer``
drives, so its refusals are the Trainer's), a part of the fit's session under its name
in the LightningModule; a placed node with parameters is trained
where it runs by a ``Split``: the user's (``trains={node_id: Split(...)}``), else a
mirror of the Lightning optimizer that holds its parameters (same class and
hyper-parameters), whose parameters are then taken out of that optimizer.

    route = GraphRoute.open(strategy, trainer, {"body": Split(SGD, lr=0.1)}, session)
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from .._errors import Refused
from .._learning import Learning
from .._memory import params_of
from ..torch import GraphModule, Split
from ..torch._session import Session
from ..torch.graph._refuse import settle
from ..torch.graph._step import Step
from ._callback import graph_modules
from ._route import Route

log = logging.getLogger(__name__)


class GraphRoute(Route):
    """The GraphModules of one LightningModule that place a node, by name, each on its
    own ``Step``."""

    def __init__(self, modules: dict[str, GraphModule], runs: dict[str, Step]):
        self.modules, self.runs = modules, runs

    @override
    @classmethod
    def names(cls, strategy: Any, model: Any) -> list[str]:
        return [n for gm in graph_modules(model) for n in gm.graph.ids]

    @override
    @classmethod
    def open(cls, strategy: Any, trainer: Any, trains: Mapping[str, Any],
             session: Session) -> GraphRoute | None:
        model = strategy.lightning_module
        chosen = _trains(strategy, model, trainer, trains) if trainer.training else {}
        named = {name: m for name, m in model.named_modules()
                 if isinstance(m, GraphModule) and m.graph.placement.hosts}
        if not named:
            return None
        if chosen:
            _limits(strategy, trainer)
        runs = {}
        try:
            for name, gm in named.items():
                mine = {n: t for n, t in chosen.items() if n in gm.graph.catalog}
                runs[name] = Step(gm.graph, mine, store=gm.store,
                                  optimizers=strategy.optimizers, defer=False,
                                  session=session, name=name)
                gm.runner = _runner(runs[name])
        except BaseException:
            for name in runs:  # refused at a later module: the earlier ones run here again
                named[name].runner = None
            raise
        hosts = sorted({h for run in runs.values() for h in run.running.placement.workers()})
        log.info("the graph's placed nodes run on workers %s", hosts)
        return cls(named, runs)

    @override
    def part_of(self, name: str) -> str | None:
        return name if name in self.runs else None

    @property
    @override
    def trains(self) -> bool:
        return any(run.trains for run in self.runs.values())

    @override
    def before_step(self) -> None:
        for run in self.runs.values():
            run.discard()  # a step whose loss got no backward leaves nothing behind

    @override
    def after_backward(self) -> None:
        for run in self.runs.values():
            run.backward()

    @override
    def optimizer_stepped(self, optimizer: Any) -> None:
        for run in self.runs.values():
            run.step_trainers()

    @override
    def bring_weights_here(self) -> None:
        for run in self.runs.values():
            if run.trains:
                run.pull()

    @override
    def state_out(self, checkpoint: dict[str, Any]) -> None:
        states = {name: run.pull() for name, run in self.runs.items() if run.trains}
        if states:
            checkpoint.setdefault("somatize", {})["trainers"] = states

    @override
    def state_in(self, checkpoint: Mapping[str, Any]) -> None:
        for name, states in checkpoint.get("somatize", {}).get("trainers", {}).items():
            if name in self.runs:
                self.runs[name].load_state({n: {"trainer": st} for n, st in states.items()})

    @override
    def on_exception(self, exception: BaseException) -> None:
        trained = [name for name, run in self.runs.items() if run.trains]
        if isinstance(exception, KeyboardInterrupt) and trained:
            log.warning("interrupted (Ctrl-C): what the placed nodes of %s trained on the "
                        "workers is not brought here: the weights here and a checkpoint "
                        "written now are those of the last epoch end, validation or "
                        "checkpoint. Resume from the last checkpoint", trained)

    @override
    def close(self, pull: bool) -> None:
        try:
            if pull:
                self.bring_weights_here()
        finally:
            for name, run in self.runs.items():
                self.modules[name].runner = None  # its own forward again
                run.discard()


def _limits(strategy: Any, trainer: Any) -> None:
    # the graph route's trainers (Split) hold their own optimizers: no autocast, scaler
    # or clipping reaches them. The placed route (place=) has all three
    if type(strategy.precision_plugin) is not Precision:
        raise Refused(
            f"precision={trainer.precision!r}: a GraphModule's nodes trained on workers "
            "(Split) run in full precision only (autocast and a loss scale do not reach "
            "their optimizers). Use lightning.Trainer(precision='32-true'), or place "
            "plain submodules with SomatizeStrategy(place=...), which honours precision")
    if trainer.gradient_clip_val:
        raise Refused(
            "gradient_clip_val with a GraphModule's nodes trained on workers (Split): the "
            "norm would be taken over the weights here only. Train without "
            "gradient_clip_val, or place plain submodules with SomatizeStrategy(place="
            "...), which clips over every parameter as one piece would")


def _trains(strategy: Any, model: Any, trainer: Any, trains: Mapping[str, Any]
            ) -> dict[str, Learning]:
    """What trains each placed node: ``trains``' entry, else a mirror of the optimizer
    here that holds its parameters (which are then taken out of that optimizer)."""
    out: dict[str, Learning] = {}
    for gm in graph_modules(model):
        g = gm.graph
        settle(g)  # before params are read: what is frozen is not trained
        for n in g.ids:
            host = g.placement.get(n)
            params = {id(p) for p in params_of(g.catalog[n]) if p.requires_grad}
            if n in trains:
                if host is None:
                    raise Refused(f"trains names {n!r}, which runs here: SomatizeStrategy "
                                  f"trains placed nodes; give {n!r} .at('worker') or train "
                                  "it with Lightning's optimizer")
                t = trains[n]
                out[n] = copy.copy(t) if isinstance(t, Learning) else Split(t)
                if n in g.memory.frozen:
                    continue  # refused by the step, with the Trainer's words
            elif host is not None and params and n not in g.memory.frozen:
                opt = next((o for o in strategy.optimizers for grp in o.param_groups
                            for p in grp["params"] if id(p) in params), None)
                if opt is None:
                    continue  # no optimizer here holds it: it is not trained
                if strategy.lr_scheduler_configs:
                    raise Refused(f"node {n!r} would be trained on worker {host!r} by a "
                                  "mirror of the local optimizer, which cannot follow a "
                                  "learning-rate scheduler: pass trains= explicitly")
                out[n] = Split(type(opt), **opt.defaults)
            else:
                continue
            # one step per backward unless Lightning accumulates (or the user steps)
            out[n].accumulates = not (model.automatic_optimization
                                      and trainer.accumulate_grad_batches == 1)
            _take_out(strategy.optimizers, n, host, params)
    return out


def _take_out(optimizers: list, n: str, host: str, params: set[int]) -> None:
    taken = 0
    for opt in optimizers:
        for grp in opt.param_groups:
            keep = [p for p in grp["params"] if id(p) not in params]
            taken += len(grp["params"]) - len(keep)
            grp["params"] = keep
    if taken:
        log.info("node %r is trained on worker %r: its %d parameter tensors were taken out "
                 "of Lightning's optimizers", n, host, taken)


def _runner(step: Step) -> Callable[..., Any]:
    """GraphModule's forward under the strategy: the step's, placed stretches on workers."""
    graph = step.graph

    def run(x: Any, *, feeds: Mapping[str, Any] | None, training: bool) -> Any:
        inputs = dict(feeds) if feeds is not None else dict.fromkeys(graph.roots, x)
        return step.forward(inputs, training=training)

    return run
