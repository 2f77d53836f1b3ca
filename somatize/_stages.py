"""Stages: where a training step's forward must stop and its backward start again.

    cut(p, c)  = (where(p), trained(p)) != (where(c), trained(c))
    level(n)   = 0 with no predecessors, else max(level(p) + cut(p, n))
    stage k    = the nodes with level(n) == k

    stages(g, trained={"body"})   # [{"body"}, {"head"}]
"""

from __future__ import annotations

from collections.abc import Iterable

from ._errors import GraphError


def cut(graph, trained: set[str], p: str, c: str) -> bool:
    """Whether the edge ``p -> c`` is cut: it crosses a host or a trainer."""
    where = graph.placement.get
    return (where(p), p in trained) != (where(c), c in trained)


def levels(graph, trained: Iterable[str]) -> dict[str, int]:
    """Each node's stage number."""
    trained = set(trained)
    unknown = trained - set(graph.ids)
    if unknown:
        raise GraphError(
            f"trained nodes {sorted(unknown)} are not in the graph; its nodes are {list(graph.ids)}"
        )
    level: dict[str, int] = {}
    for n in graph.plan.order:
        level[n] = max(
            (level[p] + cut(graph, trained, p, n) for p in graph.preds[n]), default=0
        )
    return level


def stages(graph, trained: Iterable[str] = ()) -> list[set[str]]:
    """The stages of a training step, each a set of node ids, in forward order."""
    level = levels(graph, trained)
    out: list[set[str]] = [set() for _ in range(max(level.values(), default=-1) + 1)]
    for n, k in level.items():
        out[k].add(n)
    return out
