"""One backward pass over there for the calls whose backwards meet in one pass here.

Under ``create_graph`` a placed call's backward is a call of its own (its answer, du/dx,
is differentiable: ``_here._Remote``), whose graph over there reaches into the first
call's. When a later loss reaches both (a PINN's loss of u and du/dx; an R1 penalty's
backward), one piece's engine runs both graphs in one pass, summing what reaches each
weight and each intermediate once, in its own order. Run apart over there, each would add
its share in turn: a few ulps off. So the answer's node here takes its parent's token as
an argument (the engine here runs it first), and when the parent will run in the same pass
its backward waits (``defer``): the parent's backward takes it along (``waited``), and the
worker runs both from their roots in one ``torch.autograd.backward``.

    du, = torch.autograd.grad(u.sum(), x, create_graph=True)  # call 1, child of call 0
    (du.pow(2).mean() + u.mean()).backward()  # call 1 waits; call 0's pass does both
"""

from __future__ import annotations

from typing import Any

from .._private import graph_task
from ._there import _backward


def defer(link: Any, ctx: Any, crossing: list, joined: tuple) -> list:
    """The backward of the create_graph answer ``ctx`` in the pass that runs its parent's
    too: its dL/d(outputs) wait for the parent's (with those that waited for it,
    ``joined``). The parent's arguments' gradients come with the parent's answer; the
    ones asked of this call alone (the gradients it was given, its first arguments), now."""
    parent, needs = ctx.parent, ctx.needs
    waiting = link.waiting.setdefault(parent.number, (graph_task(), []))[1]
    waiting.extend([*joined, (ctx.number, crossing)])
    own = sum(needs[:len(needs) - len(parent.inputs)])
    back = [None] * sum(needs)
    if own:
        got = link._rpc(_backward, link.name, ctx.number, crossing, link.outgoing(), False,
                        None, None, joined)
        got = [g for g, need in zip(got, needs, strict=True) if need]
        back[:own] = [None if g is None else g.to(link.here) for g in got[:own]]
    return back


def waited(link: Any, number: int) -> tuple:
    """The backwards of this pass that wait for call ``number``'s (those of other passes,
    left by a pass that stopped before reaching their parent, go)."""
    if not link.waiting:
        return ()
    task = graph_task()
    got = link.waiting.pop(number, None)
    link.waiting = {n: w for n, w in link.waiting.items() if w[0] == task}
    return tuple(got[1]) if got is not None and got[0] == task else ()
