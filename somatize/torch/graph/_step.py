"""One training step of a graph, whoever drives it: ``Trainer`` and ``SomatizeStrategy``
are thin callers of this one implementation, so a refusal of one is a refusal of all.

It covers what is refused before the first step (``refuse``), settling what is frozen,
which values are named, the forward and the backward across cuts, the trainers' steps
over there, and the trained state in and out. With a trainer standing somewhere the
step walks the stages (``somatize.stages``) forward, each stage handed fresh leaves;
the backward walks them in reverse: each trainer is handed dL/d(its output) by the
transport's generic call and answers dL/d(its input), what sits between trainers here
is walked through by autograd, one call per stage.

    step = Step(g, {"body": Split(SGD, lr=0.1)}, store=None, optimizers=[opt])
    out = step.forward({"body": x})        # the sink's value, a leaf that takes dL/dy
    objective(out, target).backward()      # fills the last stage's leaves
    step.backward()                        # trainers learn; nodes here get their .grad
    step.state()                           # {node: {"node": weights, "trainer": state}}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..._engine import Outcome, output, walk
from ..._errors import NoGradient, Refused, check_workers
from ..._graph import Graph
from ..._learning import COMPUTES, IN, Envelope, Learning, Position, around, node_of
from ..._memory import params_of
from ..._naming import naming
from ..._stages import stages
from ..._trace import span
from ..._values import bare
from .._session import Session
from .._state import restore
from ._calls import (
    _feeds_back,
    _forget_trainers,
    _learn,
    _load_trainer,
    _read_trainer,
    _step_trainers,
)
from ._globals import NodeGlobals
from ._handed import asks_grad, leaf_of, plus
from ._mirrored import Following, Mirrored, _after, mirrored
from ._refuse import refuse, settle
from ._split import narrowed


class Step:
    """The training step of ``graph`` with ``trains`` standing around their nodes.

    Args:
        graph: the user's graph.
        trains: ``{node_id: Learning}``: what trains each node where it runs.
        workers: ``{host: Worker}`` for placed nodes (local processes when not given).
        store: a directory or Keeper where ``.cached()`` nodes are kept.
        optimizers: the optimizers here. A placed node whose weights they hold and that
            ``trains`` leaves out is trained where it runs by mirrors of them
            (``Mirrored``; the driver tells ``following`` when they step and zero);
            holding the weights of a node in ``trains`` is refused.
        defer: let a remote root trainer nobody upstream needs dL/dx from take its
            gradient with the next step's input (one round trip per step); a driver that
            steps trainers itself, right after the backward, says False.
        micro_batches: how many pieces a batch is cut into (``Pipeline`` drives them):
            above 1, every trainer accumulates (stepped once per batch, by the driver)
            and keeps that many activations in flight, and nothing is deferred.
        session: the run's ``Session`` this step is a part of, under ``name`` (a fit's,
            shared with its other parts); a session of its own over ``workers`` when not
            given.
    """

    def __init__(self, graph: Graph, trains: Mapping[str, Learning] | None = None, *,
                 workers: Mapping[str, Any] | None = None, store: Any = None,
                 optimizers: Iterable[torch.optim.Optimizer] = (), defer: bool = True,
                 micro_batches: int = 1, session: Session | None = None, name: str = ""):
        self.graph = graph
        check_workers(workers)  # before anything else is refused or settled
        self.trains: dict[str, Learning] = dict(trains or {})
        optimizers = [o for o in optimizers if o is not None]
        self.trains.update(mirrored(graph, self.trains, optimizers))
        refuse(graph, self.trains, optimizers)
        settle(graph)
        if micro_batches > 1:  # set before the trainers are sent to where they run
            for trainer in self.trains.values():
                trainer.accumulates, trainer.in_flight = True, micro_batches
            defer = False
        for n, trainer in self.trains.items():  # so is this: a copy over there reads it
            trainer.feeds_back = any(
                a in self.trains or _trainable(graph, a) for a in graph.ancestors(n))
        # the graph that runs (trainers around their nodes): this step's own object, so the
        # runtime the transport holds for it is this step's alone (its own session there)
        self.running = around(graph, self.trains) if self.trains else Graph(
            graph.catalog, graph.edges, graph.placement, graph.memory)
        self.own = session is None  # then closing the step closes the session
        self.session = Session(workers=workers) if session is None else session
        self.part = self.session.open(name, self.running, store=store)
        self.keeper = self.part.keeper
        self.node_globals = NodeGlobals(self.part, self.running)
        self.naming = naming(graph, self.keeper, self.runtime)
        self.sinks = graph.sinks
        self.made: dict[str, Any] | None = None  # the forward awaiting its backward
        self.owed: dict[str, Any] = {}  # gradients deferred to the next step's input
        self._plan_stages(defer)
        followed = [n for n, t in self.trains.items() if isinstance(t, Mirrored)]
        self.following: Following | None = None
        if followed:
            try:  # the mirrors are built over there now, and checked
                self.following = Following(self.part, graph, followed, optimizers)
            except BaseException:
                self.close()
                raise

    def _plan_stages(self, defer: bool) -> None:
        # read off the graph once: it does not change once built
        graph, trains = self.graph, self.trains
        self.stages = stages(graph, trains) if trains else []
        self.orders = [[a for a in self.running.plan.order if node_of(a) in stage]
                       for stage in self.stages]
        sinks = set(self.sinks)
        self.wanted = [  # per stage: the values read by a later stage or the objective
            [n for n in stage if n in sinks or any(c not in stage for c in graph.successors(n))]
            for stage in self.stages]
        # per stage: its trainers in the order the backward asks them, and the values
        # autograd walks back through here
        self.trainers = [[n for n in reversed(graph.plan.order) if n in stage and n in trains]
                         for stage in self.stages]
        self.through = [[n for n in wanted if n not in trains] for wanted in self.wanted]
        # the last stage's untrained sinks are read by the objective alone: handed as they
        # are, so loss.backward() goes on through that stage in the same call
        self.kept = {n for n in self.wanted[-1] if n not in trains} if self.stages else set()
        # (a mirrored node's step comes between its learn and its next forward: never)
        self.deferrable = {
            n for n, t in trains.items()
            if defer and graph.placement.get(n) is not None and not graph.preds[n]
            and not t.feeds_back and not isinstance(t, Mirrored)}

    # -- forward ----------------------------------------------------------------------
    def forward(self, inputs: Mapping[str, Any], *, training: bool = True,
                meanwhile: Callable[[], None] | None = None) -> Any:
        """Run the graph on ``{root: input}``; return the sink's value as the objective
        reads it. Driven in stages when a trainer stands and autograd records (the
        backward then waits in ``backward()``). ``meanwhile()`` is called once the first
        stretches are sent, before anything runs here."""
        if self.trains and training and torch.is_grad_enabled():
            if self.made is not None:
                raise Refused(
                    f"the graph {self.graph!r} ran twice in one training step: its trainers "
                    "keep one activation each until the backward. Run it once per step "
                    "(concatenate the batches), or train it in one piece")
            out, self.made = self._staged(inputs, meanwhile)
            return out
        self.follow_math()
        if self.following is not None:
            self.following.send()  # a step of the mirrors, before they run
        fed = {Position(r, IN) if r in self.trains else r: v for r, v in inputs.items()}
        out = walk(self.running, self.running.plan.order, inputs=fed, keeper=self.keeper,
                   naming=self.naming, training=training, remote=self.runtime,
                   wanted=self.sinks, meanwhile=meanwhile)
        self._count(out)
        return output(self.graph, out.values, self.sinks)

    def _staged(self, inputs: Mapping[str, Any], meanwhile) -> tuple[Any, dict[str, Any]]:
        fed: dict[Any, Any] = {}
        made: dict[Any, Any] = {}  # node -> (value, its leaf); a trained root's input
        for r, x in inputs.items():
            if r in self.trains and asks_grad(x):
                # an input with history here (a module before the graph): dL/dx goes back
                made[Position(r, IN)] = bare(x)
                self._feed_back(r)
            if r in self.owed:
                fed[Position(r, IN)] = Envelope(self.owed.pop(r), x)
            else:
                fed[Position(r, IN) if r in self.trains else r] = x
        handed: dict[str, Any] = {}  # each value as later stages (and the objective) got it
        for k in range(len(self.orders)):
            self._count(self.stage_forward(k, fed, handed, made,
                                           meanwhile if k == 0 else None))
        return output(self.graph, handed, self.sinks), made

    def _feed_back(self, r: str) -> None:
        """Have root ``r``'s trainer answer dL/d(its input) from now on, here and where it
        stands (it was built not to when nothing upstream of it trains)."""
        trainer = self.trains[r]
        if not trainer.feeds_back:
            trainer.feeds_back = True
            self.deferrable.discard(r)
            self._at(r, _feeds_back, r)

    def stage_forward(self, k: int, fed: Mapping[Any, Any], handed: dict[str, Any],
                      made: dict[str, Any], meanwhile: Callable[[], None] | None = None
                      ) -> Outcome:
        """Walk stage ``k`` on ``fed`` (its roots' inputs) and what earlier stages
        ``handed``; add what it hands on to ``handed`` and its leaves to ``made``."""
        if k == 0:
            self.follow_math()
            if self.following is not None:
                self.following.send()  # the mirrors' step and zero_grad, before they run
        out = walk(self.running, self.orders[k], inputs=fed, given=handed,
                   keeper=self.keeper if k == 0 else None, naming=self.naming and k == 0,
                   training=True, remote=self.runtime, wanted=self.wanted[k],
                   meanwhile=meanwhile)
        for n in self.wanted[k]:
            if n in self.kept:
                handed[n] = out.values[n]
                continue
            # each stage starts a fresh autograd graph: what it is handed is a leaf
            handed[n], made[n] = leaf_of(out.values[n], n in self.trains)
        return out

    @property
    def runtime(self) -> Any:
        """The runtime the placed nodes run on (its part's; None when nothing is placed)."""
        return self.part.runtime

    def follow_math(self) -> None:
        """Send the workers this process's math settings, when they changed (the session's),
        and the globals the code of the nodes placed there reads."""
        self.part.follow_math()
        self.node_globals.follow()

    def _count(self, out: Outcome) -> None:
        self.part.count(out.pids, _called)

    def where(self) -> dict[str, dict[int, int]]:
        """Which processes ran each node, and how often: ``{node: {pid: times}}``."""
        return self.part.where()

    # -- backward ---------------------------------------------------------------------
    def backward(self) -> None:
        """Walk the stages of the last forward back: trainers get dL/d(output) and answer
        dL/d(input); what sits between them here is walked through by autograd."""
        made, self.made = self.made, None
        if made is None:
            return
        owed: dict[str, Any] = {}  # dL/d(value) that trainers answered, by producer
        for k in reversed(range(len(self.stages))):
            self.stage_backward(k, made, owed)

    def stage_backward(self, k: int, made: Mapping[str, Any], owed: dict[str, Any],
                       defer: bool = True) -> None:
        """Walk stage ``k`` back: its trainers get dL/d(output) (from ``made``'s leaves and
        what later trainers ``owed``) and add what they answer to ``owed`` by producer;
        what sits between them here is walked through by autograd. ``defer``: a deferrable
        trainer's gradient waits for the next step's input."""
        preds = self.graph.preds

        back: list[tuple[Any, Any]] = []  # (value here, dL/d(value)) for autograd

        def signal(n: str) -> Any:
            leaf = made[n][1] if made.get(n) else None
            return plus(None if leaf is None else leaf.grad, owed.pop(n, None))

        for n in self.trainers[k]:
            s = narrowed(signal(n), self.trains[n].wire)  # as it crosses to the trainer
            if defer and n in self.deferrable:
                self.owed[n] = s
                continue
            grad_in = bare(self.learn(n, s))  # bare: cast back if it crossed narrowed
            if grad_in is not None and preds[n]:
                (p,) = preds[n]
                owed[p] = plus(owed.get(p), grad_in)
            elif grad_in is not None and made.get(Position(n, IN)) is not None:
                fed_in = made[Position(n, IN)]  # a root fed a value with history here
                back.append((fed_in, grad_in.to(fed_in.device)))
        values, grads = [v for v, _ in back], [g for _, g in back]
        for n in self.through[k]:
            if not made.get(n) or not made[n][0].requires_grad:
                continue
            s = signal(n)
            if s is not None:
                values.append(made[n][0])
                grads.append(s)
        if values:
            with span(f"backward stage {k} here", "node"):
                torch.autograd.backward(values, grads)

    def discard(self) -> None:
        """Forget a forward whose loss got no backward (nothing is kept for it)."""
        self.made = None

    def learn(self, n: str, signal: Any) -> Any:
        """Hand ``n``'s trainer dL/d(output), where it stands; return dL/d(input) or None."""
        with span(f"backward {n}", "node"):
            return self._at(n, _learn, n, signal)

    def flush(self) -> None:
        """Deliver the gradients still owed to trainers (done before reading or closing)."""
        for n in list(self.owed):
            self.learn(n, self.owed.pop(n))

    def check_gradients(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Raise ``NoGradient`` naming the nodes here whose weights the optimizers hold and
        that got no gradient (never for what is trained elsewhere)."""
        held = {id(p) for o in optimizers if o is not None
                for group in o.param_groups for p in group["params"]}
        missing = sorted(
            n for n, node in self.graph.catalog.items()
            if n not in self.trains and self.graph.placement.get(n) is None
            and n not in self.graph.memory.frozen
            and any(p.requires_grad and p.grad is None and id(p) in held
                    for p in params_of(node)))
        if missing:
            raise NoGradient(
                f"nodes {missing} are trained here but got no gradient in this step: nothing "
                "between them and the loss handed one back (a trainer that answers None, or a "
                "detach). Train them where they run (trains={...}), freeze them (.frozen()), "
                "or leave their parameters out of the optimizer")

    # -- the trainers' steps and state --------------------------------------------------
    def step_trainers(self, names: Iterable[str] | None = None) -> None:
        """Apply what accumulating trainers learned (when the optimizer here steps):
        those of ``names``, or every one."""
        by_host: dict[str | None, list[str]] = {}
        for n in self.trains if names is None else names:
            if self.trains[n].accumulates and not isinstance(self.trains[n], Mirrored):
                by_host.setdefault(self.graph.placement.get(n), []).append(n)
        for host, ns in by_host.items():
            self._on(host, _step_trainers, ns)

    def forget(self) -> None:
        """Make every trainer forget a step that failed midway: the activations awaiting
        their gradient and what it accumulated (``Learning.forget``)."""
        self.made, self.owed = None, {}
        by_host: dict[str | None, list[str]] = {}
        for n in self.trains:
            by_host.setdefault(self.graph.placement.get(n), []).append(n)
        for host, ns in by_host.items():
            self._on(host, _forget_trainers, ns)

    def state(self) -> dict[str, dict[str, Any]]:
        """Each trained node's weights and its trainer's state, read where they live:
        ``{node: {"node": {name: tensor}, "trainer": {...}}}``."""
        self.flush()
        return {n: self._at(n, _read_trainer, n) for n in self.trains}

    def load_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Put back what ``state()`` gave, where the trained nodes live."""
        self.flush()
        for n, got in state.items():
            if n in self.trains:
                self._at(n, _load_trainer, n, got.get("node") or {}, got.get("trainer") or {})

    def pull(self) -> dict[str, dict[str, Any]]:
        """Copy the trained weights into this process's nodes; return the trainers' states."""
        states = {}
        for n, got in self.state().items():
            if self.graph.placement.get(n) is not None:
                restore(self.graph.catalog[n], got["node"])
            states[n] = got["trainer"]
        return states

    def close(self) -> None:
        """End this step's run over there, stopping the workers nobody else uses (what is
        owed is not delivered); its session too when it is the step's own."""
        self.part.close()
        if self.own:
            self.session.close()

    def _at(self, n: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self._on(self.graph.placement.get(n), fn, *args)

    def _on(self, host: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        # what runs where the trainers live: here against our own graph, or over there
        # against the worker's live one, by the transport's generic call
        if host is None:
            return fn(self.running, *args)
        queued = self.following.taken(host) if self.following is not None else None
        if queued:  # what the mirrors queued there rides with the call, done first
            return self.part.call(host, _after, queued, fn, *args)
        return self.part.call(host, fn, *args)


# -- small pieces ----------------------------------------------------------------------

def _trainable(graph: Graph, n: str) -> bool:
    return n not in graph.memory.frozen and any(p.requires_grad for p in params_of(graph[n]))


def _called(n: Any) -> tuple[str, int]:
    """The user's node an id of the trained graph is a call of, the trainer's compute
    ranked first: a trained node is counted once per call, where it computed."""
    return node_of(n), 0 if type(n) is Position and n.at == COMPUTES else 1
