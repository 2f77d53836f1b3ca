"""The prefix rule, and the check that a declared ``.frozen()`` was obeyed.

A node's output can be kept only if nothing upstream of it, itself included, can
change: what is restored is a leaf (training above it would stop in silence), and
a node that still trains gets a new key every step (it would only fill the store).

    cacheable(g)          # raises Refused naming the cached node and the culprit
"""

from __future__ import annotations

from typing import Any

from ._errors import NotSettled, Refused
from ._node import kind_of


def params_of(node: Any) -> list:
    """The tensors a node says are its parameters (none when it says nothing)."""
    params = getattr(node, "parameters", None)
    return list(params()) if callable(params) else []


def has_state(node: Any) -> bool:
    """Whether a node says it has weights (by the ``parameters()`` duck)."""
    try:
        return bool(params_of(node))
    except TypeError:
        return False


# what checks a settled node for a change since it was settled (its weights loaded again,
# a setting written) and digests it again: registered by somatize.torch
_resettle: list = []


def on_settled(check) -> None:
    """Register ``check(node)``: called before a settled node's digest is read."""
    if check not in _resettle:
        _resettle.append(check)


def state_digest(node: Any) -> str | None:
    """The digest of a settled node's state, set by ``somatize.torch.freeze`` (and set
    again when what it was taken over changed since)."""
    if getattr(node, "_soma_digest", None) is not None:
        for check in _resettle:
            check(node)
    return getattr(node, "_soma_digest", None)


def check_settled(graph, nodes=None) -> None:
    """Refuse a node declared ``.frozen()`` that has state and no digest."""
    for n in nodes if nodes is not None else graph.memory.frozen:
        node = graph.catalog[n]
        if n in graph.memory.frozen and state_digest(node) is None and has_state(node):
            raise NotSettled(
                f"node {n!r} ({kind_of(node)}) is declared .frozen() and has weights, but they "
                "were never settled: call somatize.torch.freeze(g) before running it, so its "
                "weights stop changing and their digest names what it produces"
            )


def cacheable(graph, memory=None) -> None:
    """Apply the prefix rule to every cached node; raise ``Refused`` naming the culprit."""
    memory = memory or graph.memory
    for n in memory.cached:
        for a in [n, *sorted(graph.ancestors(n))]:
            if a not in memory.frozen:
                who = "itself" if a == n else f"its ancestor {a!r}"
                raise Refused(
                    f"node {n!r} is .cached() but {who} can still change (it is not "
                    f".frozen()): what is kept is a leaf, so training above it would stop, "
                    f"and its name would change every step. Declare {a!r} .frozen() "
                    f"(and call somatize.torch.freeze(g)), or drop .cached() from {n!r}"
                )
    check_settled(graph)
