"""Nodes and how they compose: ``A >> B`` in sequence, ``A | B`` side by side.

    class Body(Node):
        def __init__(self):
            self.lin = nn.Linear(8, 6)      # no super().__init__() needed
        def forward(self, x, ctx):
            return Done(Opaque(self.lin(x).relu()))

    expr = Body().at("gpu") >> Head()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._errors import GraphError
from ._holes import adapted


@dataclass(frozen=True)
class Ctx:
    """Where a node stands when it runs: its id, its host (None = here), training or not."""

    node: str
    host: str | None = None
    training: bool = False


class Node:
    """A piece of a graph: ``forward(x, ctx)`` returns ``Done(value)``.

    Declarations chain and return the node: ``.at(host)``, ``.frozen()``,
    ``.cached(salt=None)``, ``.mapped(exact=False)``, ``.named(id)``. Subclasses need not call
    ``super().__init__()``: every declaration has a class-level default.
    """

    _soma_host: str | None = None
    _soma_frozen: bool = False
    _soma_cached: bool = False
    _soma_salt: str | None = None
    _soma_mapped: bool = False
    _soma_exact: bool = False
    _soma_name: str | None = None

    def forward(self, x: Any, ctx: Ctx):
        raise NotImplementedError(f"{type(self).__name__} must define forward(self, x, ctx)")

    def at(self, host: str | None) -> Node:
        """Run this node on the worker called ``host`` (None = here)."""
        self._soma_host = host
        return self

    def frozen(self) -> Node:
        """Declare that this node's state does not change while the graph runs."""
        self._soma_frozen = True
        return self

    def cached(self, salt: str | None = None) -> Node:
        """Keep this node's output in the store; ``salt`` names what the key cannot see."""
        if salt is not None and not isinstance(salt, str):
            raise GraphError(
                f"{kind_of(self)}.cached(salt={salt!r}): a salt is a string that goes into the "
                "key (what the key cannot see, e.g. salt='a100-fp16'), or None")
        self._soma_cached = True
        self._soma_salt = salt
        return self

    def mapped(self, exact: bool = False) -> Node:
        """Declare that each output row depends only on its input row (along dim 0): a
        ``.cached()`` node is then kept and looked up item by item, so shuffled batches hit.
        ``exact=True``: refuse where a kept row would differ from what computing its batch
        as it came gives (docs/per-item.md), at the cost of a second forward of a miss."""
        if not isinstance(exact, bool):
            raise GraphError(f"{kind_of(self)}.mapped(exact={exact!r}): exact is True or False")
        self._soma_mapped = True
        self._soma_exact = exact
        return self

    def named(self, id: str) -> Node:
        """Give this node an explicit id instead of its lower-cased class name."""
        self._soma_name = id
        return self

    def __rshift__(self, other) -> Seq:
        return Seq((self, as_expr(other)))

    def __rrshift__(self, other) -> Seq:
        return Seq((as_expr(other), self))

    def __or__(self, other) -> Par:
        return Par((self, as_expr(other)))

    def __ror__(self, other) -> Par:
        return Par((as_expr(other), self))


def kind_of(node: Any) -> str:
    """The class name a node is known by (a wrapped module answers for its module)."""
    return getattr(node, "_soma_kind", None) or type(node).__name__


class Expr:
    """A composition of nodes, not yet a graph: ``Graph.somatize(expr)`` makes one."""

    items: tuple

    def __rshift__(self, other) -> Seq:
        return Seq((self, as_expr(other)))

    def __rrshift__(self, other) -> Seq:
        return Seq((as_expr(other), self))

    def __or__(self, other) -> Par:
        return Par((self, as_expr(other)))

    def __ror__(self, other) -> Par:
        return Par((as_expr(other), self))


class Seq(Expr):
    """``A >> B``: every sink of A feeds every source of B."""

    def __init__(self, items):
        self.items = tuple(x for i in items for x in (i.items if isinstance(i, Seq) else (i,)))


class Par(Expr):
    """``A | B``: side by side, both fed what feeds the group."""

    def __init__(self, items):
        self.items = tuple(x for i in items for x in (i.items if isinstance(i, Par) else (i,)))


def as_expr(obj: Any) -> Node | Expr:
    """A node or an expression; anything else as a registered adapter makes it a node
    (an ``nn.Module`` by ``somatize.torch.node``)."""
    if isinstance(obj, (Node, Expr)):
        return obj
    got = adapted(obj)
    if got is not None:
        return got
    raise GraphError(
        f"cannot compose {type(obj).__name__!r} into a graph: it is not a Node. "
        "Subclass somatize.Node and define forward(self, x, ctx) -> Done(value), "
        "or wrap an nn.Module with somatize.torch.node(module)."
    )
