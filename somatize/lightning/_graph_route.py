"""The graph route: GraphModules inside a LightningModule whose nodes are placed with
``.at("worker")``. Each runs as ``somatize.torch``'s ``Step`` (the one ``Trainer``
drives, so its refusals are the Trainer's), a part of the fit's session under its name
in the LightningModule. A placed node with parameters is trained where it runs: by the
user's ``trains={node_id: Split(...)}`` (its parameters then taken out of Lightning's
optimizers), else by mirrors of the Lightning optimizers that hold them, as the placed
route's modules are (``somatize/torch/_mirror.py``): rebuilt over there group by group,
stepping when they step with the groups' hyper-parameters as they are then (a
scheduler's lr), zero_grad followed, their state merged into ``optimizer_state()`` and
handed back on load. Those parameters stay in Lightning's optimizers, ``.grad`` None here.

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
from ._private import lightning_optimizers
from ._route import Route

log = logging.getLogger(__name__)


class GraphRoute(Route):
    """The GraphModules of one LightningModule that place a node, by name, each on its
    own ``Step``."""

    def __init__(self, modules: dict[str, GraphModule], runs: dict[str, Step],
                 fitting: bool):
        self.modules, self.runs = modules, runs
        self.fitting = fitting  # validate or test: the optimizers here are left as they are
        self.closed = False
        # the runs whose nodes Lightning's optimizers' mirrors train over there
        self.following = {name: run.following for name, run in runs.items()
                          if run.following is not None}

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
        # what a fit's optimizers hold is mirrored over there (not what validate finds left)
        optimizers = strategy.optimizers if trainer.training else []
        runs = {}
        try:
            for name, gm in named.items():
                mine = {n: t for n, t in chosen.items() if n in gm.graph.catalog}
                runs[name] = Step(gm.graph, mine, store=gm.store, optimizers=optimizers,
                                  defer=False, session=session, name=name)
                gm.runner = _runner(runs[name])
            if any(run.trains for run in runs.values()):
                _limits(strategy, trainer)
            for name, run in runs.items():
                if run.following is not None:
                    _said(name, run)
                    run.following.mirror.patch_zero_grads(lightning_optimizers(strategy))
        except BaseException:
            for name, run in runs.items():  # refused: every module runs here again
                named[name].runner = None
                if run.following is not None:
                    run.following.mirror.restore()
            raise
        hosts = sorted({h for run in runs.values() for h in run.running.placement.workers()})
        log.info("the graph's placed nodes run on workers %s", hosts)
        return cls(named, runs, trainer.training)

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
            run.step_trainers()  # the trainers of trains= (mirrored nodes are not stepped so)
            if run.following is not None:
                run.following.stepped(optimizer)  # sent before the nodes' next forward

    @override
    def bring_weights_here(self) -> None:
        for run in self.runs.values():
            if run.trains:
                run.pull()

    @override
    def state_out(self, checkpoint: dict[str, Any]) -> None:
        # the trainers of trains=; the mirrors' states are in optimizer_states
        states = {}
        for name, run in self.runs.items():
            mirrored = run.following.links if run.following is not None else {}
            mine = {n: st for n, st in run.pull().items() if n not in mirrored}
            if mine:
                states[name] = mine
        if states:
            checkpoint.setdefault("somatize", {})["trainers"] = states

    @override
    def state_in(self, checkpoint: Mapping[str, Any]) -> None:
        for name, states in checkpoint.get("somatize", {}).get("trainers", {}).items():
            if name in self.runs:
                self.runs[name].load_state({n: {"trainer": st} for n, st in states.items()})
        for following in self.following.values():
            following.load(list(checkpoint.get("optimizer_states", [])))

    @override
    def optimizer_state(self, optimizer: Any, state: dict) -> dict:
        if self.closed:  # after fit the optimizers here hold what the mirrors held
            return state
        for following in self.following.values():
            state = following.optimizer_state(optimizer, state)
        return state

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
        if self.closed:
            return
        self.closed = True
        try:
            if pull:
                self.bring_weights_here()
                if self.fitting:  # after fit, the optimizers here are one piece's
                    for following in self.following.values():
                        following.keep_here()
        finally:
            for name, run in self.runs.items():
                self.modules[name].runner = None  # its own forward again
                run.discard()
            for following in self.following.values():
                following.mirror.restore()


def _limits(strategy: Any, trainer: Any) -> None:
    # autocast does not reach a graph's stretches over there, nor a loss scale its
    # trainers; clipping is not taken over them (a trains= Split's optimizer would not see
    # the norm). The placed route (place=) has all three
    if type(strategy.precision_plugin) is not Precision:
        raise Refused(
            f"precision={trainer.precision!r}: a GraphModule's nodes trained on workers run "
            "in full precision only (autocast and a loss scale do not reach them over "
            "there). Use lightning.Trainer(precision='32-true'), or place plain submodules "
            "with SomatizeStrategy(place=...), which honours precision")
    if trainer.gradient_clip_val:
        raise Refused(
            "gradient_clip_val with a GraphModule's nodes trained on workers: the norm "
            "would be taken over the weights here only. Train without gradient_clip_val, "
            "or place plain submodules with SomatizeStrategy(place=...), which clips over "
            "every parameter as one piece would")


def _trains(strategy: Any, model: Any, trainer: Any, trains: Mapping[str, Any]
            ) -> dict[str, Learning]:
    """What ``trains=`` gives the placed nodes, their parameters taken out of
    Lightning's optimizers. The placed nodes it leaves out that those optimizers hold are
    mirrored by their ``Step``."""
    out: dict[str, Learning] = {}
    for gm in graph_modules(model):
        g = gm.graph
        settle(g)  # before params are read: what is frozen is not trained
        for n in g.ids:
            if n not in trains:
                continue
            host = g.placement.get(n)
            if host is None:
                raise Refused(f"trains names {n!r}, which runs here: SomatizeStrategy "
                              f"trains placed nodes; give {n!r} .at('worker') or train "
                              "it with Lightning's optimizer")
            t = trains[n]
            out[n] = copy.copy(t) if isinstance(t, Learning) else Split(t)
            if n in g.memory.frozen:
                continue  # refused by the step, with the Trainer's words
            # one step per backward unless Lightning accumulates (or the user steps)
            out[n].accumulates = not (model.automatic_optimization
                                      and trainer.accumulate_grad_batches == 1)
            params = {id(p) for p in params_of(g.catalog[n]) if p.requires_grad}
            _take_out(strategy.optimizers, n, host, params)
    return out


def _said(name: str, run: Step) -> None:
    for n in run.following.links:
        log.info("node %r of %r is trained on worker %r by mirrors of Lightning's optimizers "
                 "that hold its parameters (they stay in them, with .grad None here)", n,
                 name, run.graph.placement.get(n))


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
