"""An argument a placed module's forward uses more than once, found over there, so that
each use's gradient comes back apart: here the argument is an input of the call's node
once per use (``_here._node``), and the engine here adds the uses' gradients to what the
tensor gets here in the order plain autograd adds them (one sum over there would round
differently: a residual, hidden states kept, cross-attention memory).

    fan = fans(outs, leaves)          # after the forward: {leaf index: [(node, input)...]}
    with heard(fan) as told: torch.autograd.backward(outs, grads)
    told[i]                           # leaf i's uses' gradients, in the order they were added
"""

from __future__ import annotations

import contextlib
import functools

from torch.autograd.graph import get_gradient_edge


def fans(outs: list, leaves: list) -> dict:
    """For each of ``leaves`` that the graph from ``outs`` uses more than once, by index:
    its uses, as ``(node, input)``, in the order of the graph's edges. Their gradients
    are answered apart, for the engine here to add them to what the tensor gets here in
    the order plain autograd would (one sum over there would round differently)."""
    accs = {get_gradient_edge(t).node: i for i, t in enumerate(leaves)}
    uses: dict = {}
    seen = set()
    stack = [t.grad_fn for t in outs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for j, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            i = accs.get(nxt)
            if i is not None:
                uses.setdefault(i, []).append((node, j))
            elif nxt not in seen:
                stack.append(nxt)
    return {i: u for i, u in uses.items() if len(u) > 1} if any(
        len(u) > 1 for u in uses.values()) else {}


@contextlib.contextmanager
def heard(fan: dict):
    """While a backward runs: each use's gradient, by argument, as the engine adds it."""
    told: dict = {i: [] for i in fan}
    handles = []
    for i, uses in fan.items():
        edges: dict = {}
        for node, j in uses:
            edges.setdefault(node, []).append(j)
        for node, js in edges.items():
            handles.append(node.register_hook(functools.partial(_hear, told[i], js)))
    try:
        yield told
    finally:
        for h in handles:
            h.remove()


def _hear(into: list, edges: list, grad_inputs: tuple, grad_outputs: tuple) -> None:
    into.extend(grad_inputs[j] for j in edges)
