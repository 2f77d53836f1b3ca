"""What the strategy asks of a route: the graph route (GraphModules whose nodes are
placed with ``.at(...)``) and the placed route (submodules placed by name, ``place=``)
answer the same questions, so ``SomatizeStrategy`` holds a list of routes and asks each
in turn, never which kind it is.

    session = Session(workers=strategy.workers)       # what the fit's routes share
    routes = [r for kind in ROUTES if (r := kind.open(strategy, trainer, trains, session))]
    for r in routes: r.optimizer_stepped(optimizer)
    session.where(); session.close()                  # asked of the session, not a route
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
    def open(cls, strategy: Any, trainer: Any, trains: Mapping[str, Any],
             session: Session) -> Route | None:
        """This route for the fit starting, as parts of the fit's ``session`` (None when
        the model has nothing for it); ``trains``: the entries of ``trains=`` it names."""

    @abstractmethod
    def part_of(self, name: str) -> str | None:
        """The session part that runs ``name`` (a GraphModule's name, a placed path), or
        None when this route does not run it."""

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

    def on_exception(self, exception: BaseException) -> None:
        """The fit ends with ``exception`` (before teardown; on a Ctrl-C,
        ``KeyboardInterrupt``, the session stops the workers right after): say what is
        lost, ask nothing more of the workers."""
        return None  # nothing to do unless the route says otherwise

    @abstractmethod
    def close(self, pull: bool) -> None:
        """The fit is over: bring the weights here (``pull``), give the modules their own
        forward back. Its parts may stay open for a validate or test after fit (the
        session closes them)."""
