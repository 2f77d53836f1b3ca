"""The Trainer: a graph trained with an objective, in one piece or in stages. The step
itself is ``Step``'s (``_step.py``), the one the Lightning strategy drives too; the
Trainer adds the objective, the local optimizer, and the loop.

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

    Trainer(g, cross_entropy, opt, trains=trains, micro_batches=4)   # 1F1B: _pipeline.py
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..._errors import Refused, SomatizeError
from ..._graph import Graph
from ..._learning import Learning
from ..._memory import has_state
from ..._trace import span
from .._state import restore, snapshot
from .._tracer import Tracer
from ..cache._per_item import mapped_counts, say_if_never_hit
from ._pipeline import Pipeline
from ._step import Step

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
        trace: a path: write a Chrome trace-event file of the run there (Perfetto,
            chrome://tracing), written at the end of ``fit`` and at ``close``.
        micro_batches: cut each batch into this many pieces (``tensor_split`` along dim
            0) that go through the stages in a 1F1B schedule, so the workers compute
            while this process does (``_pipeline.py``): each piece's loss divided by it,
            gradients accumulated in piece order, every optimizer stepped once per batch
            (the trainers in ``trains`` are set to accumulate and keep that many
            activations). The same numbers as one piece trained on the same cut with the
            same accumulation, when at most one side draws random numbers.
    """

    def __init__(
        self,
        graph: Graph,
        objective: Callable[[Any, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        trains: Mapping[str, Learning] | None = None,
        workers: Mapping[str, Any] | None = None,
        store: Any = None,
        trace: str | os.PathLike | None = None,
        micro_batches: int = 1,
    ):
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or \
                micro_batches < 1:
            raise Refused(
                f"Trainer(micro_batches={micro_batches!r}) for the graph {list(graph.roots)} "
                f"-> {list(graph.sinks)}: give how many pieces to cut each batch into, a whole "
                "number from 1 (the whole batch at once), e.g. micro_batches=4")
        self.graph = graph
        self.objective = objective
        self.optimizer = optimizer
        self.trains: dict[str, Learning] = dict(trains or {})
        self.micro_batches = micro_batches
        self._tracer = Tracer(trace) if trace is not None else None
        self._step = Step(graph, self.trains, workers=workers, store=store,
                          optimizers=[optimizer], micro_batches=micro_batches)
        self._pipeline = Pipeline(self._step, micro_batches) if micro_batches > 1 else None
        if self._tracer is not None:
            self._tracer.add(self._step.runtime)
        self._roots = graph.roots
        # where the far side's step waits for the next input (one round trip per step), the
        # local one waits too: it is taken while the next step's first stretch computes
        # (not when it steps mirrors over there too: theirs goes before that stretch)
        self._following = self._step.following
        self._later = bool(self._step.deferrable) and optimizer is not None \
            and self._following is None
        self._unstepped = False  # the last step's local optimizer step, not yet taken
        self._fitting = False  # inside fit nobody reads the weights here between two steps

    # -- one step ---------------------------------------------------------------------
    def step(self, batch: tuple[Any, Any]) -> float:
        """Train on one ``(input, target)`` batch; return the loss as a float."""
        x, target = _pair(batch)
        if self._pipeline is not None:
            return self._step_pieces(x, target)
        step = self._step
        out = step.forward(dict.fromkeys(self._roots, x), meanwhile=self._step_local)
        loss = _scalar(self.objective(out, target))
        loss.backward()
        if step.trains:
            step.backward()
            step.check_gradients([self.optimizer])
        if self.optimizer is not None:
            self._unstepped = True
            if not (self._later and self._fitting):
                self._step_local()  # a step() on its own leaves the weights here up to date
        return loss.item()

    def _step_pieces(self, x: Any, target: Any) -> float:
        # micro-batches: every piece there and back (the trainers step at the end), then here
        try:
            loss = self._pipeline.run(x, target, lambda out, t: _scalar(self.objective(out, t)))
            if self._following is not None:
                self._pipeline.wait()  # every learn of the mirrored nodes, before they step
            if self._step.trains:
                self._step.check_gradients([self.optimizer])
        except BaseException:
            if self.optimizer is not None:
                self.optimizer.zero_grad()  # what the failed batch accumulated here
            raise
        if self.optimizer is not None:
            self._unstepped = True
            self._step_local()
        return loss.item()

    def _step_local(self) -> None:
        if self._unstepped:
            self._unstepped = False
            with span("optimizer step here", "step"):
                self.optimizer.step()
            self.optimizer.zero_grad()
            if self._following is not None:  # its mirrors too (sent before their forward)
                self._following.stepped(self.optimizer)
                self._following.zeroed(self.optimizer)

    def flush(self) -> None:
        """Deliver what a step left owed: gradients to trainers, the local optimizer's step."""
        self._step_local()  # first: it needs no worker, and a lost one must not lose it
        if self._pipeline is not None:
            self._pipeline.wait()  # the trainers' steps still in flight
        self._step.flush()

    @property
    def runtime(self) -> Any:
        """The ``Runtime`` this trainer's placed nodes run on (None when nothing is placed)."""
        return self._step.runtime

    def where(self) -> dict[str, dict[int, int]]:
        """Which processes ran each node, and how often: ``{node: {pid: times}}``."""
        return self._step.where()

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
        if self._tracer is not None:
            self._tracer.write()
        return losses

    def _epochs(self, data, epochs: int, bar, losses: list[float]) -> None:
        for epoch in range(epochs):
            bar.set_description(f"epoch {epoch + 1}/{epochs}", refresh=False)
            total, seen = 0.0, 0
            counts = mapped_counts(self.graph)  # per-item hits and misses before the epoch
            for batch in data:
                losses.append(self.step(batch))
                total, seen = total + losses[-1], seen + 1
                bar.set_postfix(loss=f"{total / seen:.4f}", refresh=False)
                bar.update()
            log.info("epoch %d/%d: mean loss %.6f over %d steps", epoch + 1, epochs,
                     total / max(seen, 1), seen)
            say_if_never_hit(self.graph, epoch, counts)

    # -- what was trained -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Weights of every node, the local optimizer's state and every trainer's state.

        Weights trained on a worker are read over there: this is how they are seen here.
        """
        self.flush()
        nodes = {n: snapshot(node) for n, node in self.graph.catalog.items() if has_state(node)}
        trainers = {}
        for n, got in self._step.state().items():
            nodes[n], trainers[n] = got["node"], got["trainer"]
        optimizer = None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())
        if optimizer is not None and self._following is not None:  # one piece's entries
            optimizer = self._following.optimizer_state(self.optimizer, optimizer)
        return {"nodes": nodes, "optimizer": optimizer, "trainers": trainers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what ``state_dict`` gave: weights here and there, optimizers' states."""
        self.flush()
        trained = self._step.trains  # the mirrored nodes too: their weights are over there
        for n, weights in state["nodes"].items():
            if n not in trained:
                restore(self.graph.catalog[n], weights)
        self._step.load_state({n: {"node": state["nodes"].get(n, {}),
                                   "trainer": state["trainers"].get(n, {})}
                               for n in trained})
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            if self._following is not None:
                self._following.load([state["optimizer"]])

    def close(self) -> None:
        """Deliver what is owed and stop the worker processes this trainer started."""
        try:
            rt = self._step.runtime
            if rt is not None and not getattr(rt, "closed", False):  # Ctrl-C stopped it: no
                self.flush()  # worker is left to deliver to, and none must be waited for
            if self._tracer is not None:
                self._tracer.write(end=True)
        finally:
            if self._pipeline is not None:
                self._pipeline.close()
            self._step.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise SomatizeError(
        f"Trainer.step takes a batch (input, target); got a {type(batch).__name__}"
        f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}: make the data "
        "yield pairs, e.g. a DataLoader over TensorDataset(x, y)")


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else f"a {type(loss).__name__}")
        raise SomatizeError(
            f"the objective returned {what}, not a scalar loss: end it with a reduction "
            "(.mean() or .sum()), e.g. objective=lambda y, t: F.cross_entropy(y, t)")
    return loss
