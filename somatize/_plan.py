"""The plan: when each node runs. Waves of nodes that depend on none of each other,
and the same waves cut into units — a node here, or a stretch of consecutive nodes
on one worker that runs in one call.

    plan(g).waves             # (("body",), ("head",))
    units(g, g.ids, here=None)  # [[Unit("gpu", ("body",))], [Unit(None, ("head",))]]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ._errors import GraphError


@dataclass(frozen=True)
class Plan:
    """Waves of node ids in dependency order; nodes of one wave are independent."""

    waves: tuple[tuple[str, ...], ...]

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(n for w in self.waves for n in w)


@dataclass(frozen=True)
class Unit:
    """What one call runs: ``host`` None is a node here, else a stretch on that worker."""

    host: str | None
    nodes: tuple[str, ...]


def plan(graph) -> Plan:
    """Order the graph's nodes into waves (raises GraphError on a cycle)."""
    level: dict[str, int] = {}
    indegree = {n: len(ps) for n, ps in graph.preds.items()}
    succ: dict[str, list[str]] = {n: [] for n in graph.preds}
    for p, c in graph.edges:
        succ[p].append(c)
    ready = [n for n in graph.preds if indegree[n] == 0]
    for n in ready:
        level[n] = 0
    i = 0
    while i < len(ready):
        n = ready[i]
        i += 1
        for c in succ[n]:
            level[c] = max(level.get(c, 0), level[n] + 1)
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    if len(ready) != len(indegree):
        stuck = [n for n in graph.preds if n not in level or indegree[n] > 0]
        raise GraphError(
            f"the graph has a cycle through {', '.join(stuck)}: a node cannot feed itself, "
            "even through others; compose it without reusing a node object downstream of itself"
        )
    waves: dict[int, list[str]] = {}
    for n in graph.preds:  # keep composition order inside a wave
        waves.setdefault(level[n], []).append(n)
    return Plan(tuple(tuple(waves[k]) for k in sorted(waves)))


def units(
    preds: Mapping[str, tuple[str, ...]],
    order: Iterable[str],
    hosts: Mapping[str, str | None],
    here: str | None = None,
) -> list[list[Unit]]:
    """Group the nodes of ``order`` (a topological order) into waves of units.

    Consecutive nodes on one other host join one stretch when that creates no cycle
    between units; stretches of one wave can be in flight at the same time.
    """
    order = list(order)
    inside = set(order)
    unit_of: dict[str, int] = {}
    members: list[list[str]] = []
    unit_host: list[str | None] = []
    upstream: list[set[int]] = []  # units each unit depends on, transitively

    for n in order:
        h = hosts.get(n)
        h = None if h == here else h
        ps = [p for p in preds[n] if p in inside]
        deps: set[int] = set()
        for p in ps:
            deps.add(unit_of[p])
            deps |= upstream[unit_of[p]]
        joined = None
        if h is not None:
            for p in ps:
                u = unit_of[p]
                if unit_host[u] != h:
                    continue
                # joining u is safe when no other predecessor's unit depends on u
                if all(unit_of[q] == u or u not in upstream[unit_of[q]] for q in ps):
                    joined = u
                    break
        if joined is None:
            members.append([n])
            unit_host.append(h)
            upstream.append(deps)
            unit_of[n] = len(members) - 1
        else:
            members[joined].append(n)
            upstream[joined] |= deps - {joined}
            unit_of[n] = joined
    level: dict[int, int] = {}
    for u in range(len(members)):  # units are created in topological order
        direct = {unit_of[p] for n in members[u] for p in preds[n] if p in inside} - {u}
        level[u] = 1 + max((level[d] for d in direct), default=-1)
    waves: dict[int, list[Unit]] = {}
    for u in range(len(members)):
        waves.setdefault(level[u], []).append(Unit(unit_host[u], tuple(members[u])))
    return [waves[k] for k in sorted(waves)]
