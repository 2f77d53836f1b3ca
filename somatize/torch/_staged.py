"""A training step driven in stages: forward stage by stage, each stage handed fresh
leaves, then back in reverse, where trainers are asked for dL/d(input) and what sits
between them here is walked through by autograd. ``Trainer`` and ``SomatizeStrategy``
drive their steps with it; what computes the loss and steps the local optimizer is theirs.

    staged = Staged(graph, {"body": Split(SGD, lr=0.1)}, remote=runtime)
    out, made = staged.forward({"body": x})     # the sink's value, a leaf that takes dL/dy
    objective(out, target).backward()           # fills the last stage's leaves
    staged.backward(made)                       # trainers learn; nodes here get their .grad
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._engine import output, walk
from .._graph import Graph
from .._learning import COMPUTES, IN, Envelope, Learning, around, position_of
from .._memory import params_of
from .._stages import stages
from .._values import Opaque, bare


class Staged:
    """The staged step of ``graph`` with ``trains`` standing around their nodes.

    Args:
        graph: the user's graph.
        trains: ``{node_id: Learning}``; each trainer stands in two positions (``around``).
        remote: the transport placed stretches go to (a ``Runtime``), if any.
        defer: let a remote root trainer nobody upstream needs dL/dx from take its
            gradient with the next step's input (one round trip per step); a driver that
            steps trainers itself, right after the backward, says False.
    """

    def __init__(self, graph: Graph, trains: Mapping[str, Learning], *, remote: Any = None,
                 defer: bool = True):
        self.graph = graph
        self.trains = dict(trains)
        self.running = around(graph, self.trains)  # the graph that runs
        self.remote = remote
        self.keeper: Any = None  # where stage 0's cached nodes are looked up here
        self.naming = False  # whether stage 0 names its values (a keeper here or there)
        self.stages = stages(graph, self.trains)
        self.orders = [[a for a in self.running.plan.order if position_of(a) in stage]
                       for stage in self.stages]
        for n, trainer in self.trains.items():
            trainer.feeds_back = any(
                a in self.trains or _trainable(graph, a) for a in graph.ancestors(n))
        self.sinks = graph.sinks
        sinks = set(self.sinks)
        self.wanted = [  # per stage: the values read by a later stage or the objective
            [n for n in stage if n in sinks or any(c not in stage for c in graph.successors(n))]
            for stage in self.stages
        ]
        # per stage, read off the graph once: its trainers in the order the backward asks
        # them, and the values autograd walks back through here
        self.trainers = [[n for n in reversed(graph.plan.order) if n in stage and n in self.trains]
                         for stage in self.stages]
        self.through = [[n for n in wanted if n not in self.trains] for wanted in self.wanted]
        # the last stage's untrained sinks are read by the objective alone: handed as they
        # are, so loss.backward() goes on through that stage in the same call
        last = len(self.stages) - 1
        self.kept = {n for n in self.wanted[last] if n not in self.trains} if self.stages else set()
        self.deferrable = {
            n for n, t in self.trains.items()
            if defer and graph.placement.get(n) is not None and not graph.preds[n]
            and not t.feeds_back
        }
        self.owed: dict[str, Any] = {}  # gradients deferred to the next step's input

    def forward(self, inputs: Mapping[str, Any], meanwhile: Callable[[], None] | None = None,
                ) -> tuple[Any, dict[str, Any]]:
        """Walk the stages forward on ``{root: input}``; return the output as the objective
        reads it and what each stage made, for ``backward``. ``meanwhile()`` is called once
        stage 0's stretches are sent, before anything runs here."""
        fed: dict[str, Any] = {}
        for r, x in inputs.items():
            if r in self.owed:
                fed[r + IN] = Envelope(self.owed.pop(r), then=x, carries=True)
            else:
                fed[r + IN if r in self.trains else r] = x
        handed: dict[str, Any] = {}  # each value as later stages (and the objective) got it
        made: dict[str, Any] = {}  # node -> (value, its leaf)
        for k, order in enumerate(self.orders):
            out = walk(self.running, order, inputs=fed, given=handed,
                       keeper=self.keeper if k == 0 else None, naming=self.naming and k == 0,
                       training=True, remote=self.remote, wanted=self.wanted[k],
                       meanwhile=meanwhile if k == 0 else None)
            for n in self.wanted[k]:
                if n in self.kept:
                    handed[n] = out.values[n]
                    continue
                # each stage starts a fresh autograd graph: what it is handed is a leaf
                handed[n], made[n] = _leaf(out.values[n], n in self.trains)
        return output(self.graph, handed, self.sinks), made

    def backward(self, made: Mapping[str, Any]) -> None:
        """Walk the stages back: trainers get dL/d(output) and answer dL/d(input); what
        sits between them here is walked through by autograd, one call per stage."""
        preds = self.graph.preds
        owed: dict[str, torch.Tensor] = {}  # dL/d(value) that trainers answered, by producer

        def signal(n: str) -> Any:
            leaf = made[n][1] if made.get(n) else None
            return _plus(None if leaf is None else leaf.grad, owed.pop(n, None))

        for k in reversed(range(len(self.stages))):
            for n in self.trainers[k]:
                s = signal(n)
                if n in self.deferrable:
                    self.owed[n] = s
                    continue
                grad_in = self.learn(n, s)
                if grad_in is not None and preds[n]:
                    (p,) = preds[n]
                    owed[p] = _plus(owed.get(p), grad_in)
            values, grads = [], []
            for n in self.through[k]:
                if not made.get(n) or not made[n][0].requires_grad:
                    continue
                s = signal(n)
                if s is not None:
                    values.append(made[n][0])
                    grads.append(s)
            if values:
                torch.autograd.backward(values, grads)

    def learn(self, n: str, signal: Any) -> Any:
        """Hand ``n``'s trainer dL/d(output), where it stands; return dL/d(input) or None."""
        out = walk(self.running, [n], given={n + COMPUTES: Envelope(signal)}, training=True,
                   remote=self.remote)
        return bare(out.values[n]).signal

    def flush(self) -> None:
        """Deliver the gradients still owed to trainers (done before reading or closing)."""
        for n in list(self.owed):
            self.learn(n, self.owed.pop(n))


def _trainable(graph: Graph, n: str) -> bool:
    return n not in graph.memory.frozen and any(p.requires_grad for p in params_of(graph[n]))


def _leaf(value: Any, trained: bool) -> tuple[Any, tuple[torch.Tensor, torch.Tensor] | None]:
    """A value handed across a stage boundary: a tensor that can take a gradient (a
    trainer's detached output, or one with history here) becomes a leaf that asks for it."""
    t = bare(value)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not (
            trained or t.requires_grad):
        return value, None
    leaf = t.detach().requires_grad_()
    return (Opaque(leaf) if isinstance(value, Opaque) else leaf), (t, leaf)


def _plus(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else a + b
