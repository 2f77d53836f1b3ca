"""What is refused before a graph's first training step, by every driver (``Trainer``,
``SomatizeStrategy``), and settling what is declared frozen or cached.

    refuse(g, {"body": Split(SGD, lr=0.1)}, optimizers=[opt])   # raises Refused
    settle(g)                                                   # .frozen() made true
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..._errors import Refused
from ..._graph import Graph
from ..._learning import Learning
from ..._memory import cacheable, check_settled, params_of
from ..._node import kind_of
from ..._stages import levels
from ..cache._freeze import freeze
from ._mirrored import Mirrored


def refuse(graph: Graph, trains: Mapping[str, Any],
           optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
    """Raise ``Refused`` for a training run that cannot be what it says, naming the nodes."""
    refuse_unknown(trains, graph.ids)
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
                f".frozen() from {n!r} or take {n!r} out of trains")
        if not callable(getattr(node, "parameters", None)):
            raise Refused(
                f"node {n!r} ({kind_of(node)}) is trained but does not say what its parameters "
                f"are: define parameters(self) on {kind_of(node)} returning its tensors")
        if len(graph.preds[n]) > 1:
            raise Refused(
                f"node {n!r} is trained and has two producers {list(graph.preds[n])}: it would "
                "owe a different gradient to each, which is not done. Join them in a node of "
                f"their own before {n!r}, or train {n!r} in one piece with the rest")
    if graph.memory.cached and trains:
        level = levels(graph, trains)
        late = sorted(n for n in graph.memory.cached if level[n] > 0)
        if late:
            raise Refused(
                f"nodes {late} are .cached() after a cut (stage {max(level[n] for n in late)}): "
                "a stage's roots are handed values, not their recipes, so two batches would be "
                f"kept under one name. Cache only before the first cut, or drop .cached() from "
                f"{late}")
    held = {id(p) for o in optimizers for group in o.param_groups for p in group["params"]}
    both = sorted(n for n in trains if not isinstance(trains[n], Mirrored)  # (held: mirrored)
                  and any(id(p) in held for p in params_of(graph.catalog[n])))
    if both:
        raise Refused(
            f"the local optimizer holds weights of {both}, which are also trained where "
            "they run: each step would move them twice. Build it over "
            "parameters(g, without=trains)")


def refuse_unknown(trains: Iterable[str], ids: Iterable[str], placed: Iterable[str] = ()
                   ) -> None:
    """Refuse ``trains`` naming nodes that are not among ``ids`` (nor among ``placed``,
    the paths of submodules placed by name)."""
    ids, placed = list(ids), sorted(placed)
    unknown = sorted(set(trains) - set(ids) - set(placed))
    if unknown and not placed:
        raise Refused(
            f"trains names {unknown}, which are not in the graph; its nodes are {ids}. Key "
            "trains by node id (a node's id is its class name in lower case, or what "
            ".named('...') says)")
    if unknown:
        raise Refused(
            f"trains names {unknown}, which are not in the graph nor placed: key trains by "
            f"a placed module's path {placed}, or by a GraphModule node's id {ids}")


def settle(graph: Graph) -> None:
    """Make ``.frozen()`` true (``freeze``) and check the prefix rule where a cache is
    declared, before anything runs."""
    if graph.memory.frozen:
        freeze(graph)
    if graph.memory.cached:
        cacheable(graph)
    check_settled(graph)


def parameters(graph, without: Iterable[str] | Mapping[str, Any] = ()) -> list[torch.nn.Parameter]:
    """The parameters of the graph's nodes that the local optimizer should hold.

    Leaves out the nodes in ``without`` (pass ``trains``), frozen nodes, and tensors
    that do not require a gradient; each tensor appears once.
    """
    skip = set(without)
    seen: set[int] = set()
    out = []
    for n, node in graph.catalog.items():
        if n in skip or n in graph.memory.frozen:
            continue
        for p in params_of(node):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
