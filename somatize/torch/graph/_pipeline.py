"""Micro-batches: a batch cut into pieces that go through the stages in a 1F1B schedule,
so that the coordinator and its workers compute at once.

    step = Step(g, trains, optimizers=[opt], micro_batches=4)
    pipe = Pipeline(step, 4)
    loss = pipe.run(x, target, objective)    # every piece there and back; trainers step
    opt.step(); opt.zero_grad()              # once per batch, here as over there

The batch is cut with ``tensor_split(k)`` along dim 0, each piece a tensor of its own (a
piece that crosses to a worker arrives 64-byte aligned, and the CPU matrix kernels round
unaligned float32 input differently in the last bit). Piece i's loss is
``objective(out_i, target_i) / k``; gradients accumulate in piece order, here and in every
trainer (``accumulates``), and every optimizer steps once per batch: the numbers of one
piece trained on the same cut with the same accumulation, bit for bit, when at most one
side draws random numbers. The batch's loss is the sum of the pieces' in piece order.

The schedule is a list of typed actions: ``F`` (a stage's forward of a piece), ``L`` (the
objective of a piece and its ``backward()`` into the last stage), ``B`` (a stage's
backward: its trainers learn, autograd walks what is here). It is read off the classic
1F1B timeline: stage s of m runs min(m-1-s, k) forwards ahead, then one forward, one
backward, then the backwards left, so a stage holds at most m-s pieces in flight. A stage
that runs wholly on workers is a *lane*: its actions are sent as early as their inputs
allow, from one thread that sends them in order, each once the last is answered; the
coordinator goes on meanwhile, runs the rest in the timeline's order, and waits only for
what it reads. With the body on a worker (stage 0, a lane) and the head here (stage 1),
k = 4, in columns of what runs at once:

    worker:  F0  F1        B0 F2     B1 F3     B2        B3 step
    here:        F0 L0 B0  F1 L1 B1  F2 L2 B2  F3 L3 B3  step

so the worker computes piece i+1's body while the coordinator computes piece i's head;
each side takes its pieces in order, so a side that draws random numbers draws what one
piece would. With no lane (every stage here, or none wholly on workers) there is nothing
to overlap, and the pieces run one after another, in one piece's own order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..._engine import output
from ..._errors import Refused
from ..._learning import IN, Position
from ..._values import Opaque, bare

log = logging.getLogger(__name__)
_NOTHING = object()


class Kind(str, Enum):
    """What an action does: F a stage's forward, L the objective and its backward into
    the last stage, B a stage's backward."""

    F = "F"
    L = "L"
    B = "B"


@dataclass(frozen=True)
class Action:
    """One thing the schedule does: ``kind`` (``Kind``: F, L, B) of ``stage`` (L: the
    last) for micro-batch ``piece``. ``Action(Kind.F, 0, 1)`` reads as ``Kind.F``."""

    kind: Kind
    stage: int
    piece: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))

    def __repr__(self) -> str:
        return f"{self.kind.value}{self.stage}({self.piece})"


def in_order(stages: int, pieces: int) -> list[Action]:
    """Each piece forward through every stage, its objective, and back, one after another."""
    out = []
    for i in range(pieces):
        out += [Action(Kind.F, s, i) for s in range(stages)]
        out.append(Action(Kind.L, stages - 1, i))
        out += [Action(Kind.B, s, i) for s in reversed(range(stages))]
    return out


def one_f_one_b(stages: int, pieces: int, lanes: Iterable[int] = ()) -> list[Action]:
    """The classic 1F1B timeline read slot by slot (in each slot every stage whose next
    action's inputs were made in an earlier slot takes it); then each action of a stage
    on a lane is moved as early as its inputs allow: it is only sent, and computes over
    there while the coordinator runs its own."""
    seqs = []
    for s in range(stages):
        ahead = min(stages - 1 - s, pieces)
        seq = [Action(Kind.F, s, i) for i in range(ahead)]
        for j in range(pieces - ahead):
            seq += [Action(Kind.F, s, ahead + j), Action(Kind.B, s, j)]
        seq += [Action(Kind.B, s, i) for i in range(pieces - ahead, pieces)]
        seqs.append(seq)
    at = [0] * stages
    slot_of: dict[Action, int] = {}
    timeline: list[Action] = []
    slot = 0
    while any(at[s] < len(seqs[s]) for s in range(stages)):
        for s in range(stages):
            if at[s] == len(seqs[s]):
                continue
            a = seqs[s][at[s]]
            if any(slot_of.get(n, slot) >= slot for n in _needs(a, stages)):
                continue
            at[s] += 1
            slot_of[a] = slot
            timeline.append(a)
            if a.kind == Kind.F and s == stages - 1:  # the objective follows the last forward
                slot_of[Action(Kind.L, s, a.piece)] = slot
                timeline.append(Action(Kind.L, s, a.piece))
        slot += 1
    lanes = set(lanes)
    queued = {s: [a for a in timeline if a.stage == s and a.kind != Kind.L] for s in lanes}
    out: list[Action] = []
    done: set[Action] = set()

    def send_ready() -> None:
        moved = True
        while moved:
            moved = False
            for q in queued.values():
                while q and all(n in done for n in _needs(q[0], stages)):
                    out.append(q[0])
                    done.add(q.pop(0))
                    moved = True

    send_ready()
    for a in timeline:
        if a.stage in lanes and a.kind != Kind.L:
            continue
        out.append(a)
        done.add(a)
        send_ready()
    return out


class _Lane:
    """A stage that runs wholly on workers: one thread sends its actions in order, each
    once the last is answered. After a failure it refuses what follows, with that error."""

    def __init__(self, stage: int):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"somatize-stage{stage}")
        self.failed: BaseException | None = None

    def send(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.pool.submit(self._run, fn, args)

    def _run(self, fn: Callable[..., Any], args: tuple) -> Any:
        if self.failed is not None:
            raise self.failed
        try:
            return fn(*args)
        except BaseException as e:
            self.failed = e
            raise


class _Piece:
    """What one micro-batch has made so far (the same dicts a whole step's forward fills)."""

    __slots__ = ("fed", "target", "handed", "made", "owed", "loss", "out")

    def __init__(self, fed: dict, target: Any):
        self.fed, self.target = fed, target
        self.out: Any = _NOTHING  # the sink's value, when the graph is walked whole
        self.handed: dict[str, Any] = {}
        self.made: dict[str, Any] = {}
        self.owed: dict[str, Any] = {}
        self.loss: torch.Tensor | None = None


class Pipeline:
    """Train ``step``'s graph on batches cut into ``pieces`` micro-batches (see above).

    Args:
        step: the step of the graph, built with ``micro_batches=pieces``.
        pieces: how many micro-batches a batch is cut into (k).
    """

    def __init__(self, step: Any, pieces: int):
        self.step, self.pieces = step, pieces
        placed = step.running.placement.get
        # a stage every node of which runs on a worker: sent from a lane of its own
        self.lanes = {s: _Lane(s) for s, order in enumerate(step.orders)
                      if order and all(placed(a) is not None for a in order)}
        m = len(step.orders) or 1  # no stages: the plain forward is the one stage
        self.schedule = one_f_one_b(m, pieces, self.lanes) if self.lanes else in_order(
            m, pieces)
        self.pending: list[Future] = []  # lane work nobody has waited for (trainers' steps)

    def run(self, x: Any, target: Any, objective: Callable[[Any, Any], torch.Tensor]
            ) -> torch.Tensor:
        """Every piece of ``(x, target)`` forward and back, then every trainer's step;
        return the batch's loss (detached). The optimizer here is the caller's to step."""
        step, k = self.step, self.pieces
        xs, ts = cut(x, k, "input"), cut(target, k, "target")
        rows, t_rows = _rows(x), _rows(target)
        if rows < k or rows != t_rows:
            raise Refused(
                f"a batch of {rows} rows (target: {t_rows}) cannot be cut into {k} "
                f"micro-batches for the graph {list(step.graph.roots)} -> {list(step.sinks)}: "
                f"give batches of at least {k} rows, as many in the input as in the target, "
                "or fewer micro_batches")
        roots = {r: Position(r, IN) if r in step.trains else r for r in step.graph.roots}
        pieces = [_Piece({fed: xi for fed in roots.values()}, ti)
                  for xi, ti in zip(xs, ts, strict=True)]
        sent: dict[Action, Future] = {}
        try:
            for a in self.schedule:
                if a.stage in self.lanes and a.kind != Kind.L:
                    sent[a] = self.lanes[a.stage].send(self._act, a, pieces, objective, sent)
                else:
                    self._act(a, pieces, objective, sent)
            self._step_trainers()
        except BaseException:
            self._abandon(list(sent.values()))
            raise
        self.pending += [f for f in sent.values() if not f.done()]
        total = pieces[0].loss
        for p in pieces[1:]:
            total = total + p.loss
        return total

    def _act(self, a: Action, pieces: list[_Piece], objective, sent: dict) -> None:
        step, p = self.step, pieces[a.piece]
        for need in _needs(a, len(self.step.orders)):
            if need in sent:
                sent[need].result()  # made on a lane: wait for it (here or on another lane)
        if a.kind == Kind.F and not step.orders:  # nothing trained where it runs: one walk
            p.out = step.forward(p.fed)
        elif a.kind == Kind.F:
            step._count(step.stage_forward(a.stage, p.fed, p.handed, p.made))
        elif a.kind == Kind.L:
            out = output(step.graph, p.handed, step.sinks) if p.out is _NOTHING else p.out
            loss = objective(out, p.target)
            loss = loss / self.pieces
            loss.backward()
            p.loss = loss.detach()
        elif step.orders:
            step.stage_backward(a.stage, p.made, p.owed, defer=False)

    def _step_trainers(self) -> None:
        # once per batch, after each trainer's last learn: on its lane, where it has one
        step = self.step
        for s, lane in self.lanes.items():
            if step.trainers[s]:
                self.pending.append(lane.send(step.step_trainers, step.trainers[s]))
        here = [n for s, ns in enumerate(step.trainers) if s not in self.lanes for n in ns]
        if here:
            step.step_trainers(here)

    def _abandon(self, sent: list[Future]) -> None:
        """A batch failed midway: let what is in flight land, then forget the batch's
        activations and gradients everywhere, so the next batch starts clean."""
        sent, self.pending = sent + self.pending, []
        wait(sent)  # their errors are this one's consequences, or said by it
        for lane in self.lanes.values():
            lane.failed = None
        try:
            self.step.forget()
        except Exception as e:  # a lost worker: the error that brought us here says so
            log.warning("forgetting a failed batch: %s", e)

    def wait(self) -> None:
        """Wait for the lanes' work still in flight (trainers' steps); raise its error."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        """Stop the lanes' threads (after what they hold is sent)."""
        for lane in self.lanes.values():
            lane.pool.shutdown(wait=True)


def _needs(a: Action, stages: int) -> list[Action]:
    if a.kind == Kind.F:
        return [Action(Kind.F, a.stage - 1, a.piece)] if a.stage > 0 else []
    if a.kind == Kind.L:
        return [Action(Kind.F, a.stage, a.piece)]
    if a.stage == stages - 1:
        return [Action(Kind.L, a.stage, a.piece)]
    return [Action(Kind.B, a.stage + 1, a.piece)]


def cut(value: Any, k: int, what: str) -> list[Any]:
    """``value`` cut into ``k`` pieces along dim 0, each a fresh contiguous tensor."""
    t = bare(value)
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        what_it_is = "a tensor of no dimension" if isinstance(t, torch.Tensor) else \
            f"a {type(t).__name__}"
        raise Refused(
            f"micro_batches={k} cuts each batch's {what} along its first dimension, and this "
            f"{what} is {what_it_is}: give tensors with a batch dimension, or micro_batches=1")
    # each piece a tensor of its own: a view starting mid-row rounds differently
    pieces = [p.clone(memory_format=torch.contiguous_format) for p in t.tensor_split(k)]
    return [Opaque(p) for p in pieces] if isinstance(value, Opaque) else pieces


def _rows(value: Any) -> int:
    return bare(value).shape[0]
