"""What a graph's training step runs where its trainers stand: over there by the
transport's generic call (``session.call(host, _learn, n, signal)``), against that
process's live graph, or here against the step's own.

    _learn(live, "body", signal)       # dL/d(input), or None
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._graph import Graph
from ..._node import Ctx
from .._state import on_cpu, restore, state_of


def _learn(live: Graph, node_id: str, signal: Any) -> Any:
    """Hand trainer ``node_id`` dL/d(its node's output); answer dL/d(its input) or None.
    (``node_id``: what names the node when its learn raises over there.)"""
    return live.catalog[node_id].learn(signal, Ctx(node_id, live.placement.get(node_id), True))


def _feeds_back(live: Graph, n: str) -> None:
    live.catalog[n].feeds_back = True


def _step_trainers(live: Graph, names: list[str]) -> None:
    for n in names:
        live.catalog[n].step()


def _forget_trainers(live: Graph, names: list[str]) -> None:
    for n in names:
        live.catalog[n].forget()


def _read_trainer(live: Graph, n: str) -> dict:
    trainer = live.catalog[n]  # (on the CPU: it may cross)
    return {"node": on_cpu(dict(state_of(trainer.node))), "trainer": on_cpu(trainer.state_dict())}


def _load_trainer(live: Graph, n: str, weights: Mapping[str, Any], state: dict) -> None:
    trainer = live.catalog[n]
    restore(trainer.node, weights)
    trainer.load_state_dict(state)


