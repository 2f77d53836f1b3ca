"""Settling: ``freeze(g)`` makes ``.frozen()`` true and pays once for the weights' digest;
``parameters(g, without=trains)`` is what the local optimizer should hold.

    freeze(g)                              # requires_grad_(False), eval(), digest
    SGD(parameters(g, without=trains), lr=0.1)
"""

from __future__ import annotations

from typing import Any

import torch
from blake3 import blake3

from ..._keys import digest
from ..._memory import on_settled
from .._codec import layout, to_blob
from .._private import versions
from .._state import modules_of, state_of
from ._coupled import refuse_coupled_node
from ._named import held_code, own_attributes, own_settings, settings_of
from ._watch import Watch, _inner_of, _may_mutate


def named_state(node: Any, where: str = "", salt: str | None = None
                ) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Everything that changes what a node computes: its state as named tensors (its
    ``state_dict``, non-persistent buffers and tensors held as plain attributes, each
    once) and its settings (see ``settings_of``; refused when one cannot be named)."""
    state = state_of(node)
    if not isinstance(node, torch.nn.Module):  # a graph node's own tensors, not its modules'
        seen = {id(t) for _, t in state}
        state += [(k, t) for k, t in sorted(vars(node).items(), key=lambda kv: kv[0])
                  if isinstance(t, torch.Tensor) and id(t) not in seen]
    pieces: list[str] = []
    if not isinstance(node, torch.nn.Module):  # a graph node's own settings (self.gain)
        tensors: list[tuple[str, torch.Tensor]] = []
        pieces += own_settings(node, where or type(node).__name__, salt, tensors)
        seen = {id(t) for _, t in state}
        state += [(k, t) for k, t in tensors if id(t) not in seen]
    for name, m in modules_of(node):
        pieces += [f"{name}/{p}" for p in _settings(m, where or name or type(m).__name__,
                                                    salt, state, name)]
    return state, pieces


def _settings(m: torch.nn.Module, where: str, salt: str | None,
              state: list[tuple[str, torch.Tensor]], name: str) -> list[str]:
    pieces, tensors = settings_of(m, where, salt, hooks=bool(name))
    seen = {id(t) for _, t in state}
    dot = f"{name}." if name else ""
    for k, b in m.named_buffers(remove_duplicate=False):  # non-persistent ones too
        tensors.append((k, b))
    for k, t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            state.append((dot + k, t))
    return pieces


def state_digest(node: Any, where: str = "", salt: str | None = None) -> str | None:
    """The digest of what a node computes with: state and settings (None for a node with
    neither). Raises ``Refused`` for a setting that cannot be named (see ``named_state``)."""
    return digest_of(*named_state(node, where, salt))


def digest_of(state: list[tuple[str, torch.Tensor]], pieces: list[str]) -> str | None:
    """The digest of named tensors and settings, as ``named_state`` gives them."""
    if not state and not pieces:
        return None
    h = blake3()
    for name, t in state:
        blob = to_blob(t)
        lay = layout(t)  # a channels-last or transposed weight: the kernels may round otherwise
        h.update(digest([name, blob.dtype, repr(blob.shape), *([lay] if lay else [])]).encode())
        h.update(memoryview(blob.data).cast("B"))
    return digest(["state", h.hexdigest(), "settings", *pieces])


def freeze(graph) -> Any:
    """Settle every node declared ``.frozen()``: no more gradients, eval mode, a digest.

    Returns the graph, so ``freeze(g).forward(x, store=...)`` reads well.
    """
    for n in graph.memory.frozen:
        node = graph.catalog[n]
        for _, m in modules_of(node):
            m.eval()
        for _, t in state_of(node):
            if t.is_floating_point() or t.is_complex():
                t.requires_grad_(False)
        settle(node, n, graph.memory.cached.get(n))
    if graph.memory.mapped:
        for n in sorted(graph.memory.mapped):
            refuse_coupled_node(n, graph.catalog[n])
    return graph




class _Settled:
    """What a node's digest was taken over, watched (see ``Watch``); it stays in the
    process: pickled, it arrives empty (a worker's copy was digested where it was frozen)."""

    def __init__(self, node: Any, n: str, salt: str | None):
        self.n, self.salt, self.node = n, salt, node
        state = state_of(node)
        self.watches = [(m, Watch(m, state if i == 0 else [], hooks=bool(k)))
                        for i, (k, m) in enumerate(modules_of(node))]
        self.own = _own_tensors(node)  # a node's tensors held as its attributes

    def changed(self) -> bool:
        return any(w.changed(m) for m, w in self.watches) or _own_tensors(self.node) != self.own

    def __reduce__(self):
        return (_Settled.__new__, (_Settled,))


def _own_tensors(node: Any) -> list:
    # a node's own attributes by identity (tensors by version too, and what can change
    # under its identity, a function or a container, by its text)
    if isinstance(node, torch.nn.Module):
        return []
    own = own_attributes(node)
    return [(k, id(v)) for k, v in own] + versions(
        [t for _, t in own if isinstance(t, torch.Tensor)]) + _inner_of(
        [(node, k, v) for k, v in own if _may_mutate(v)])


def settle(node: Any, n: str, salt: str | None) -> None:
    """Digest a frozen node's state and settings, and watch them for a later change."""
    node._soma_digest = state_digest(node, n, salt)
    node._soma_settled = _Settled(node, n, salt)
    # the functions and classes it holds: what they read is in its key (live_state)
    node._soma_held = held_code([node, *(m for _, m in modules_of(node))])


def _settle_again(node: Any) -> None:
    # after freeze(g): weights loaded again, a setting written -> a new digest, a new name
    settled = getattr(node, "_soma_settled", None)
    if isinstance(settled, _Settled) and getattr(settled, "watches", None) is not None \
            and settled.changed():
        settle(node, settled.n, settled.salt)


on_settled(_settle_again)
