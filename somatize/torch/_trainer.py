"""The Trainer: one training step over a graph, in one piece or in stages.

With nothing trained where it runs, a step is a plain forward, ``loss.backward()``,
``optimizer.step()`` and ``zero_grad()``. With a trainer somewhere, the step walks
the stages (``somatize.stages``) forward, then back in reverse: only trainers are
transposed, what sits between them is walked through by autograd, and the local
optimizer steps once every gradient has been handed back. Where a worker trains the
first stage, its gradient rides with the next step's input (one round trip per step)
and, inside ``fit``, the local step is taken while that stretch computes (a ``step()``
on its own leaves the weights here up to date): ``flush()`` (done by ``fit``,
``state_dict`` and ``close``) delivers what is owed.

    trains = {"body": Split(SGD, lr=0.1)}
    with Trainer(g, objective=cross_entropy, optimizer=SGD(parameters(g, without=trains),
                 lr=0.1), trains=trains) as t:
        t.fit(data, epochs=10)
        weights = t.state_dict()["nodes"]["body"]     # read over there when it runs there
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._engine import output, walk
from .._errors import NoGradient, Refused
from .._graph import Graph
from .._learning import Learning
from .._memory import cacheable, check_settled, has_state, params_of
from .._node import kind_of
from .._stages import levels
from ._freeze import freeze, state_of
from ._staged import Staged

log = logging.getLogger(__name__)


class Trainer:
    """Train a graph: the half that is here with ``optimizer``, the rest with ``trains``.

    Args:
        graph: the graph to train (``Graph.somatize(...)``).
        objective: ``objective(output, target) -> loss``; output is the sink's bare
            value (``{sink: value}`` with several sinks).
        optimizer: the local optimizer, over ``parameters(graph, without=trains)``;
            None when nothing here is trained.
        trains: ``{node_id: Learning}``, what trains each node where it runs.
        workers: ``{host: Worker}`` for placed nodes (local processes when not given).
        store: a directory (or Keeper) where ``.cached()`` nodes are kept;
            ``.frozen()`` nodes are settled (``freeze``) when the trainer is built.
    """

    def __init__(
        self,
        graph: Graph,
        objective: Callable[[Any, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        trains: Mapping[str, Learning] | None = None,
        workers: Mapping[str, Any] | None = None,
        store: Any = None,
    ):
        from ..store import open_keeper

        self.graph = graph
        self.objective = objective
        self.optimizer = optimizer
        self.trains: dict[str, Learning] = dict(trains or {})
        _refuse(graph, self.trains, optimizer)
        if graph.memory.frozen:
            freeze(graph)
        if graph.memory.cached:
            cacheable(graph)  # the prefix rule, once what is frozen is settled
        check_settled(graph)
        self.keeper = open_keeper(store)
        # read off the graph once: it does not change once built
        self._order, self._roots, self._sinks = graph.plan.order, graph.roots, graph.sinks
        # trainers standing around their nodes: the step is driven in stages
        self.staged = Staged(graph, self.trains) if self.trains else None
        self.running = self.staged.running if self.staged else graph
        self.runtime = None
        if self.running.placement.hosts:
            from ..remote import runtime_for

            self.runtime = runtime_for(self.running, workers)
            self.runtime.provision(self.running)
        # keys are computed only where something cached can be kept (here or on a worker)
        self._naming = bool(graph.memory.cached) and (self.keeper is not None or bool(
            self.runtime is not None and self.runtime.keeps()))
        if self.staged:
            self.staged.remote, self.staged.keeper = self.runtime, self.keeper
            self.staged.naming = self._naming
        self._local = {  # param id -> node id, for what the local optimizer must move
            id(p): n for n, node in graph.catalog.items()
            if n not in self.trains and graph.placement.get(n) is None
            and n not in graph.memory.frozen
            for p in params_of(node) if p.requires_grad
        }
        if optimizer is not None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            self._local = {k: v for k, v in self._local.items() if k in held}
        # where the far side's step waits for the next input (one round trip per step), the
        # local one waits too: it is taken while the next step's first stretch computes
        self._later = bool(self.staged and self.staged.deferrable) and optimizer is not None
        self._unstepped = False  # the last step's local optimizer step, not yet taken
        self._fitting = False  # inside fit nobody reads the weights here between two steps

    # -- one step ---------------------------------------------------------------------
    def step(self, batch: tuple[Any, Any]) -> float:
        """Train on one ``(input, target)`` batch; return the loss as a float."""
        x, target = batch
        if not self.staged:
            return self._plain_step(x, target)
        return self._staged_step(x, target)

    def _plain_step(self, x: Any, target: Any) -> float:
        out = walk(self.graph, self._order, inputs=dict.fromkeys(self._roots, x),
                   keeper=self.keeper, naming=self._naming, training=True, remote=self.runtime,
                   wanted=self._sinks)
        loss = self.objective(output(self.graph, out.values, self._sinks), target)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss.item()

    def _staged_step(self, x: Any, target: Any) -> float:
        out, made = self.staged.forward(dict.fromkeys(self._roots, x),
                                        meanwhile=self._step_local)
        loss = self.objective(out, target)
        loss.backward()
        self.staged.backward(made)
        self._check_gradients()
        if self.optimizer is not None:
            self._unstepped = True
            if not (self._later and self._fitting):
                self._step_local()  # a step() on its own leaves the weights here up to date
        return loss.item()

    def _step_local(self) -> None:
        if self._unstepped:
            self._unstepped = False
            self.optimizer.step()
            self.optimizer.zero_grad()

    def _check_gradients(self) -> None:
        if not self._local:
            return
        missing = sorted({n for n, node in self.graph.catalog.items() if n in self._local.values()
                          for p in params_of(node) if id(p) in self._local and p.grad is None})
        if missing:
            raise NoGradient(
                f"nodes {missing} are trained here but got no gradient in this step: nothing "
                "between them and the loss handed one back (a trainer that answers None, or a "
                "detach). Train them where they run (trains={...}), freeze them (.frozen()), "
                "or leave their parameters out of the optimizer"
            )

    def flush(self) -> None:
        """Deliver what a step left owed: gradients to trainers, the local optimizer's step."""
        self._step_local()  # first: it needs no worker, and a lost one must not lose it
        if self.staged:
            self.staged.flush()

    # -- many steps ---------------------------------------------------------------------
    def fit(self, data: Iterable[tuple[Any, Any]], epochs: int = 1,
            progress: bool = True) -> list[float]:
        """Train ``epochs`` times over ``data``; return every step's loss."""
        from tqdm.auto import tqdm

        per_epoch = len(data) if hasattr(data, "__len__") else None
        losses: list[float] = []
        # one bar over every step, counted by update(): a bar that wraps the iterable
        # counts lazily, so a postfix redrawn each step showed 0/5 beside a moving loss
        with tqdm(total=None if per_epoch is None else per_epoch * epochs, unit="step",
                  desc=f"epoch 1/{epochs}", disable=not progress, dynamic_ncols=True) as bar:
            self._fitting = True
            try:
                self._epochs(data, epochs, bar, losses)
            finally:
                self._fitting = False
        self.flush()
        return losses

    def _epochs(self, data, epochs: int, bar, losses: list[float]) -> None:
        for epoch in range(epochs):
            bar.set_description(f"epoch {epoch + 1}/{epochs}", refresh=False)
            total, seen = 0.0, 0
            for batch in data:
                losses.append(self.step(batch))
                total, seen = total + losses[-1], seen + 1
                bar.set_postfix(loss=f"{total / seen:.4f}", refresh=False)
                bar.update()
            log.info("epoch %d/%d: mean loss %.6f over %d steps", epoch + 1, epochs,
                     total / max(seen, 1), seen)

    # -- what was trained -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Weights of every node, the local optimizer's state and every trainer's state.

        Weights trained on a worker are read over there: this is how they are seen here.
        """
        self.flush()
        nodes = {n: _snapshot(node) for n, node in self.graph.catalog.items() if has_state(node)}
        trainers = {}
        for n in self.trains:
            host = self.graph.placement.get(n)
            if host is None:
                got = _read_trainer(self.running, n)
            else:
                got = self.runtime.call(host, _read_trainer, n)
            nodes[n], trainers[n] = got["node"], got["trainer"]
        optimizer = None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())
        return {"nodes": nodes, "optimizer": optimizer, "trainers": trainers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what ``state_dict`` gave: weights here and there, optimizers' states."""
        self.flush()
        for n, weights in state["nodes"].items():
            if n in self.trains:
                continue
            _restore(self.graph.catalog[n], weights)
        for n in self.trains:
            host = self.graph.placement.get(n)
            args = (n, state["nodes"].get(n, {}), state["trainers"].get(n, {}))
            if host is None:
                _load_trainer(self.running, *args)
            else:
                self.runtime.call(host, _load_trainer, *args)
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Deliver what is owed and stop the worker processes this trainer started."""
        if self.runtime is not None:
            try:
                self.flush()
            finally:
                self.runtime.close()
                self.runtime = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- refused before the first step --------------------------------------------------------

def _refuse(graph: Graph, trains: Mapping[str, Any], optimizer: Any) -> None:
    unknown = sorted(set(trains) - set(graph.ids))
    if unknown:
        raise Refused(
            f"trains names {unknown}, which are not in the graph; its nodes are "
            f"{list(graph.ids)}. Key trains by node id (a node's id is its class name in "
            "lower case, or what .named('...') says)"
        )
    seen: dict[int, str] = {}
    for n, trainer in trains.items():
        if not isinstance(trainer, Learning):
            raise Refused(f"trains[{n!r}] is a {type(trainer).__name__}, not a Learning: "
                          f"write trains={{{n!r}: Split(SGD, lr=0.1)}}")
        if id(trainer) in seen:
            raise Refused(f"one trainer object trains both {seen[id(trainer)]!r} and {n!r}: "
                          "give each node its own (Split(SGD, lr=0.1) twice)")
        seen[id(trainer)] = n
    for n in trains:
        node = graph.catalog[n]
        if n in graph.memory.frozen:
            raise Refused(
                f"node {n!r} is declared .frozen() and trained: frozen says its weights do not "
                f"change while the graph runs, a trainer changes them every step. Drop "
                f".frozen() from {n!r} or take {n!r} out of trains"
            )
        if not callable(getattr(node, "parameters", None)):
            raise Refused(
                f"node {n!r} ({kind_of(node)}) is trained but does not say what its parameters "
                f"are: define parameters(self) on {kind_of(node)} returning its tensors"
            )
        if len(graph.preds[n]) > 1:
            raise Refused(
                f"node {n!r} is trained and has two producers {list(graph.preds[n])}: it would "
                "owe a different gradient to each, which is not done. Join them in a node of "
                f"their own before {n!r}, or train {n!r} in one piece with the rest"
            )
    if graph.memory.cached:
        level = levels(graph, trains)
        late = sorted(n for n in graph.memory.cached if level[n] > 0)
        if late:
            raise Refused(
                f"nodes {late} are .cached() after a cut (stage {max(level[n] for n in late)}): "
                "a stage's roots are handed values, not their recipes, so two batches would be "
                f"kept under one name. Cache only before the first cut, or drop .cached() from "
                f"{late}"
            )
    if optimizer is not None and trains:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        both = sorted(n for n in trains if any(id(p) in held for p in params_of(graph.catalog[n])))
        if both:
            raise Refused(
                f"the local optimizer holds weights of {both}, which are also trained where "
                "they run: each step would move them twice. Build it over "
                "parameters(g, without=trains)"
            )


# -- small pieces ---------------------------------------------------------------------------

def _snapshot(node: Any) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in state_of(node)}


def _restore(node: Any, weights: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in state_of(node):
            if k in weights:
                t.copy_(weights[k])


def _read_trainer(live: Graph, n: str) -> dict:
    """Read a trainer and its node's weights (run where they live, against that catalog)."""
    trainer = live.catalog[n]
    return {"node": _snapshot(trainer.node), "trainer": copy.deepcopy(trainer.state_dict())}


def _load_trainer(live: Graph, n: str, weights: Mapping[str, Any], state: dict) -> None:
    """Put weights and a trainer's state back (run where they live, against that catalog)."""
    trainer = live.catalog[n]
    _restore(trainer.node, weights)
    trainer.load_state_dict(state)
