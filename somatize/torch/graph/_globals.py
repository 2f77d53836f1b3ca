"""The module-level names a placed graph node's code reads, kept the same over there
(as a placed module's are: ``torch/placed/_globals.py``).

    node_globals = NodeGlobals(part, running)    # when the step is built
    node_globals.follow()                        # before each forward: what changed, sent

What they hold here goes with the first forward, and again whenever one is rebound
(``GAIN = 2.0``) or, a small dict, list, set or tuple of plain values, changed in place:
an ordered call of the part's session, so it is set over there before the stretch that
reads it runs. A name rebound here to what cannot travel as data is refused, naming the
node and the name.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..._graph import Graph
from ..._learning import node_of
from ..placed._globals import SetGlobals, Watched


class NodeGlobals:
    """What the code of each of a graph's nodes placed on workers reads of its globals."""

    def __init__(self, part: Any, running: Graph):
        self.part, self.running = part, running
        # each placed node once, by its id (a trained one's positions share its trainer)
        self.placed = list({node_of(n): (n, h) for n in running.plan.order
                            if (h := running.placement.get(n)) is not None}.items())
        self.watched: dict[str, Watched] = {}

    def follow(self) -> None:
        """Send each placed node's worker the globals its code reads that changed here."""
        for node, (n, host) in self.placed:
            watch = self.watched.get(n)
            if watch is None:
                watch = self.watched[n] = Watched(self.running.catalog[n])
            values = watch.changes(node, host)
            if values:
                self.part.send(host, _set_globals, n, values, watch.first)


# a live graph's node (its trainer, when trained) -> where its code reads, found at its
# first call (gone with the session's graph)
_holders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _set_globals(live: Graph, n: str, values: tuple, first: bool) -> None:
    """Over there: set ``values`` where node ``n``'s copy of the code reads them."""
    node = live.catalog[n]
    SetGlobals(values, first).apply_to(node, _holders.setdefault(node, {}))
