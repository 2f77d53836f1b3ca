"""The learning hole: what trains a node where it runs, and the envelope a gradient
rides in. No torch here: ``somatize.torch.Split`` fills the hole with tensors.

A trainer stands in two positions around the node it trains — ``Position("body", "in")``
before it, ``body`` after it — and both positions are the same object:

    ... -> (body, in) -> (body, computes) -> body -> ...
           enter(x)      the user's node      leave(y); later learn(dL/dy) -> dL/dx

    class Greedy(Learning):
        def leave(self, y, ctx): ...           # train on a local loss, here and now
        def learn(self, signal, ctx): return None   # nothing goes back upstream

Reaching a trainer in the forward is a forward like any other. Its ``learn`` is
reached by the transport's generic call (``somatize.torch``'s step driver), so a
worker runs both without knowing that training exists. A gradient deferred to the
next step rides with that step's input in an ``Envelope``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._node import Ctx
from ._values import Done, Opaque, codec_for

IN = "in"  # the position before the node; the one after it keeps the node's own id
COMPUTES = "computes"  # where the user's node runs once a trainer stands around it


class Position(NamedTuple):
    """An id of the graph a training run sees that is not a user's node: where a trained
    node's trainer stands before it (``at="in"``), or where the node itself runs."""

    node: str
    at: str

    def __repr__(self) -> str:
        return f"{self.node}:{self.at}"


class Envelope:
    """A gradient owed to a trainer from the last step (``signal``; None: "no gradient
    for you"), delivered with this step's input ``then``: one round trip, not two."""

    __slots__ = ("signal", "then")

    def __init__(self, signal: Any, then: Any):
        self.signal = signal
        self.then = then

    def __getstate__(self):
        return (self.signal, self.then)

    def __setstate__(self, state):
        self.signal, self.then = state

    def __repr__(self) -> str:
        what = "nothing" if self.signal is None else type(self.signal).__name__
        return f"Envelope({what}, then an input)"


def is_envelope(value: Any) -> bool:
    """Whether a value is a gradient on its way back (a type check, nothing built)."""
    return type(value) is Envelope


class Learning:
    """The learning hole: ``enter(x)`` at ``node:in``, ``leave(y)`` at ``node``, and
    ``learn(dL/dy) -> dL/dx`` (None: nothing goes back).

    Everything a rebuilt trainer reads is a class attribute, so an object unpickled
    on a worker (``__init__`` is not called there) is whole.
    """

    node: Any = None  # the user's node it trains, set where the trainer is placed
    feeds_back: bool = True  # whether anything upstream can take dL/dx
    # False: learn() applies what it learned at once. True: it only accumulates, and the
    # driver calls step() when its own optimizer steps (Lightning's accumulate_grad_batches)
    accumulates: bool = False
    # how many forwards may await their learn (micro-batches in flight); learn answers them
    # oldest first, and a forward beyond this many forgets the oldest (it got no backward)
    in_flight: int = 1
    # the dtype activations and gradients cross the cut in (None: as they are); the step
    # driver narrows the gradients it sends, the trainer what it answers
    wire: Any = None

    def enter(self, x: Any, ctx: Ctx) -> Any:
        """Called with the node's input; returns what the node is handed."""
        return x

    def leave(self, y: Any, ctx: Ctx) -> Any:
        """Called with the node's output; returns what the rest of the graph is handed."""
        return y

    def learn(self, signal: Any, ctx: Ctx) -> Any:
        """Given dL/d(output) (None: no gradient this step), answer dL/d(input) or None."""
        return None

    def step(self) -> None:
        """Apply what ``learn`` accumulated, then forget it (only when ``accumulates``)."""

    def forget(self) -> None:
        """Drop what a step that failed midway left: forwards awaiting their ``learn``
        and what ``learn`` accumulated, so the next step starts clean."""

    def state_dict(self) -> dict:
        """What this trainer holds beyond the node's weights (an optimizer's state)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what ``state_dict`` gave."""

    # -- standing in the graph: both positions call this one method ------------------
    def forward(self, x: Any, ctx: Ctx):
        if type(ctx.node) is Position:  # before the node
            at = Ctx(ctx.node.node, ctx.host, ctx.training)  # the hooks see the node's id
            if type(x) is Envelope:  # the last step's gradient rides with this step's input
                self.learn(x.signal, at)  # dL/dx of a root goes nowhere: dropped
                x = x.then
            return Done(_marked(self.enter(x, at)))
        return Done(_marked(self.leave(x, ctx)))


def _marked(value: Any) -> Any:
    # what has a codec (a tensor) stays marked Opaque, as the user's node returned it
    return Opaque(value) if codec_for(value) is not None else value


def node_of(n: Any) -> str:
    """The user's node an id of the trained graph stands for (``(body, in)`` -> ``body``)."""
    return n.node if type(n) is Position else n


def around(graph, trains) -> Any:
    """The graph as a training run sees it: each trainer in two positions around its node.

    ``body`` becomes ``(body, in) -> (body, computes) -> body``; the id ``body`` stays
    with the last position, so fan-in dicts downstream are keyed as they always were, and
    the node itself still sees ``ctx.node == "body"``.
    """
    catalog: dict[str, Any] = {}
    hosts: dict[str, str] = {}
    edges: list[tuple[str, str]] = []
    for n, node in graph.catalog.items():
        host = graph.placement.get(n)
        if n not in trains:
            catalog[n] = node
            ids = (n,)
        else:
            trainer = trains[n]
            trainer.node = node
            before, inside = Position(n, IN), Position(n, COMPUTES)
            catalog[before] = trainer
            catalog[inside] = node
            catalog[n] = trainer
            ids = (before, inside, n)
            edges += [(before, inside), (inside, n)]
        if host is not None:
            hosts.update(dict.fromkeys(ids, host))
    for p, c in graph.edges:
        edges.append((p, Position(c, IN) if c in trains else c))
    return graph.replace(catalog=catalog, edges=edges, hosts=hosts,
                         reports={Position(n, COMPUTES): n for n in trains})
