"""What the strategy asks of a route: the graph route (GraphModules whose nodes are
placed with ``.at(...)``) and the placed route (submodules placed by name, ``place=``)
answer the same questions, so ``SomatizeStrategy`` holds a list of routes and asks each
in turn, never which kind it is.

    routes = [r for kind in ROUTES if (r := kind.open(strategy, trainer, trains))]
    for r in routes: r.optimizer_stepped(optimizer)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from ..torch._session import Session


class Route(ABC):
    """One way a LightningModule's work runs on workers, for one fit (or validate, test,
    predict). ``trains=`` entries the route's ``names`` list are its own."""

    @classmethod
    @abstractmethod
    def names(cls, strategy: Any, model: Any) -> list[str]:
        """What ``trains=`` may name on this route, for ``model``."""

    @classmethod
    @abstractmethod
    def open(cls, strategy: Any, trainer: Any, trains: Mapping[str, Any]) -> Route | None:
        """This route for the fit starting (None when the model has nothing for it);
        ``trains``: the entries of ``trains=`` it names."""

    @abstractmethod
    def sessions(self) -> dict[str, Session]:
        """The sessions it runs on, by what they run (a GraphModule's name, a placed path)."""

    @property
    @abstractmethod
    def trains(self) -> bool:
        """Whether anything is trained over there (then a lost worker loses it)."""

    def before_step(self) -> None:
        """A training step starts: what a step whose loss got no backward left is dropped."""
        return None  # nothing to do unless the route says otherwise

    def after_backward(self) -> None:
        """The loss's backward here is done: the backward past the cut, before
        ``on_after_backward``."""
        return None  # nothing to do unless the route says otherwise

    def optimizer_stepped(self, optimizer: Any) -> None:
        """``optimizer`` stepped here: what it trains over there steps too."""
        return None  # nothing to do unless the route says otherwise

    @abstractmethod
    def bring_weights_here(self) -> None:
        """Copy the weights trained over there into the modules here."""

    def state_out(self, checkpoint: dict[str, Any]) -> None:
        """Add to ``checkpoint`` (under ``"somatize"``) what only the workers hold."""
        return None  # nothing to do unless the route says otherwise

    def state_in(self, checkpoint: Mapping[str, Any]) -> None:
        """Hand the workers their part of a checkpoint being restored."""
        return None  # nothing to do unless the route says otherwise

    def optimizer_state(self, optimizer: Any, state: dict) -> dict:
        """``state`` (the optimizer here's), with the entries held over there."""
        return state

    def settle(self) -> None:
        """Wait for the work still in flight over there."""
        return None  # nothing to do unless the route says otherwise

    def where(self) -> dict[str, dict[str, dict[int, int]]]:
        """Which processes ran what, by session name: ``{name: {node: {pid: times}}}``."""
        return {name: s.where() for name, s in self.sessions().items()}

    def traffic(self) -> tuple[float, int, int]:
        """Seconds waited on workers, bytes sent, bytes received, over its sessions."""
        got = [s.traffic() for s in {id(s): s for s in self.sessions().values()}.values()]
        return (sum(g[0] for g in got), sum(g[1] for g in got), sum(g[2] for g in got))

    def on_exception(self, exception: BaseException) -> None:
        """The fit ends with ``exception`` (before teardown): a Ctrl-C
        (``KeyboardInterrupt``) asks that teardown wait for no worker."""
        return None  # nothing to do unless the route says otherwise

    @abstractmethod
    def close(self, pull: bool) -> None:
        """The fit is over: bring the weights here (``pull``), give the modules their own
        forward back. Sessions may stay open for the next fit's reuse (``release``)."""

    def release(self) -> None:
        """End its sessions over there (idempotent)."""
        for s in {id(s): s for s in self.sessions().values()}.values():
            s.close()
