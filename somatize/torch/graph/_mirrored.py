"""A graph's node placed on a worker whose weights an optimizer here holds, and that
nothing in ``trains`` trains: it is trained where it runs by mirrors of that optimizer,
with the placed route's own ``Mirror`` (``somatize/torch/_mirror.py``). So the step is
one piece's: the same optimizer class, constructor arguments and param groups over
there, stepping when the one here steps with its groups' hyper-parameters as they are
then (a scheduler's lr), zero_grad followed, and its state merged into the optimizer's
state here under one piece's indices. The node's parameters stay in the optimizer here,
with ``.grad`` None here, so it skips them.

    trains |= mirrored(graph, trains, optimizers)       # {"body": Mirrored()}
    following = Following(part, graph, ["body"], optimizers)   # mirrors built over there
    following.send()               # before a forward: what the optimizers queued, in order
    following.stepped(optimizer)   # a StepMirror queued for each node it holds
    following.optimizer_state(optimizer, optimizer.state_dict())  # one piece's entries
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..._errors import Refused
from ..._graph import Graph
from ..._memory import params_of
from .._mirror import Mirror
from .._mirror_ops import _mirror_states, _queued
from ._graphmodule import _holder
from ._split import Split


class Mirrored(Split):
    """What trains a node over there by mirrors of the optimizers here: ``Split``'s two
    positions around the node, its ``learn`` accumulating only. What the mirror
    operations apply to: ``.module`` (the node's modules, its parameters under the names
    they have here), ``.mirrors`` (by index of the optimizer here), ``.chosen`` (None)."""

    accumulates = True  # learn() never steps: a StepMirror does, when the optimizer here does
    chosen = None  # no optimizer of the user's own over there

    def __init__(self):  # no factory: the Mirror builds the mirrors over there
        self.mirrors: dict[int, torch.optim.Optimizer] = {}

    @property
    def module(self) -> torch.nn.Module:
        held = self.__dict__.get("_module")
        if held is None:
            held = self._module = _holder(self.node)
        return held

    def step(self) -> None:
        """Nothing: the mirrors step when the optimizers here do (``StepMirror``)."""

    def forget(self) -> None:
        self._x, self._kept = None, ()
        for p in self.module.parameters():
            p.grad = None  # what a failed step accumulated (the mirrors zero to None too)

    def state_dict(self) -> dict:
        return {}  # the mirrors' states are the optimizers' here (Following.states)

    def load_state_dict(self, state: dict) -> None:
        pass  # handed with the optimizers' states (Following.load)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_module", None)  # rebuilt where it is read
        return state

    def __repr__(self) -> str:
        return "Mirrored(by mirrors of the optimizers here)"


def mirrored(graph: Graph, trains: Mapping[str, Any], optimizers: Iterable[Any]
             ) -> dict[str, Mirrored]:
    """A ``Mirrored`` for each placed node that ``trains`` leaves out, is not frozen, and
    some of whose weights that require grad an optimizer here holds."""
    held = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    out = {}
    for n in graph.ids:
        host = graph.placement.get(n)
        if n in trains or host is None or n in graph.memory.frozen:
            continue
        mine = [p for p in params_of(graph.catalog[n]) if p.requires_grad and id(p) in held]
        if not mine:
            continue
        holder = _holder(graph.catalog[n])
        named = {id(p) for p in holder.parameters()} if holder is not None else set()
        if any(id(p) not in named for p in mine):
            raise Refused(
                f"node {n!r} runs on worker {host!r} and the optimizer here holds its "
                "weights, but some of them are not in an nn.Module the node holds (an "
                "nn.Parameter set on the node itself): they could not be followed over "
                f"there by name. Keep {n!r}'s weights in nn.Module attributes, or train it "
                f"with trains={{{n!r}: Split(torch.optim.SGD, lr=...)}}")
        out[n] = Mirrored()
    return out


class NodeLink:
    """What the mirrors of node ``name`` send to where it runs (a ``Mirror``'s link):
    what they queue goes, in order, before the node's next forward or call."""

    device = None  # a graph's node computes where its weights already are

    def __init__(self, part: Any, name: str, host: str):
        self.part, self.name, self.host = part, name, host
        self.ops: list = []

    def queue(self, op: Any) -> None:
        self.ops.append(op)

    def take(self) -> list:
        ops, self.ops = self.ops, []
        return ops

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(live, name, *args, ops)`` over there now, what is queued done first."""
        return self.part.call(self.host, fn, self.name, *args, self.take())


class Following:
    """A step's mirrored nodes: their links, and the one ``Mirror`` over the optimizers
    here that keeps them in step.

    Args:
        part: the step's share of the session.
        graph: the user's graph.
        names: the mirrored nodes (``mirrored``'s keys).
        optimizers: the optimizers here (they keep the nodes' parameters).
    """

    def __init__(self, part: Any, graph: Graph, names: Iterable[str], optimizers: list):
        self.part = part
        self.links = {n: NodeLink(part, n, graph.placement.get(n)) for n in names}
        modules = {n: _holder(graph.catalog[n]) for n in self.links}
        self.mirror = Mirror(modules, self.links, optimizers)
        self.sent: list = []  # what send() sent, answered or not

    def send(self) -> None:
        """Send what the optimizers queued now, in order and without waiting: the
        forward that follows runs after it over there."""
        for n, link in self.links.items():
            if link.ops:
                self.sent.append(self.part.call_async(link.host, _queued, n, link.take()))
        while self.sent and self.sent[0].done():
            self.sent.pop(0).result()  # raises what went wrong over there

    def taken(self, host: str | None) -> dict[str, list]:
        """What is queued for the nodes on ``host``, taken (it rides with a call there)."""
        return {n: link.take() for n, link in self.links.items()
                if link.host == host and link.ops}

    def stepped(self, optimizer: Any) -> None:
        """``optimizer`` stepped here: its mirrors step (sent before the next forward)."""
        self.mirror.stepped(optimizer)

    def zeroed(self, optimizer: Any, set_to_none: bool = True) -> None:
        """``optimizer`` here cleared its gradients: so do its mirrors."""
        i = self.mirror.index(optimizer)
        if i is not None:
            self.mirror.zeroed(i, set_to_none)

    def states(self) -> dict[tuple[int, str], dict]:
        """The mirrors' states: ``{(optimizer index, node): {parameter name: entry}}``."""
        return {(i, n): by_name for n, link in self.links.items()
                for i, by_name in link.call(_mirror_states).items()}

    def optimizer_state(self, optimizer: Any, state: dict) -> dict:
        """``state`` (the optimizer here's) with its mirrors' entries, under the indices
        one piece gives them."""
        i = self.mirror.index(optimizer)
        return state if i is None else self.mirror.merged(i, state, self.states())

    def load(self, states: list) -> None:
        """Hand the mirrors their parameters' entries of the optimizers' states ``states``
        (a checkpoint's ``optimizer_states``, in the optimizers' order here)."""
        self.mirror.load(states)

    def keep_here(self) -> None:
        """The run is over: the mirrors' states become the optimizers' here."""
        self.mirror.keep_here(self.states())


def _after(live: Graph, queued: Mapping[str, list], fn: Any, *args: Any) -> Any:
    """Over there: what was queued for the nodes done first, then ``fn(live, *args)``."""
    for n, ops in queued.items():
        _queued(live, n, ops)
    return fn(live, *args)
