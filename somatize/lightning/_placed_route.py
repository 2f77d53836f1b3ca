"""The placed route: submodules of an unmodified LightningModule placed on workers by
name, ``SomatizeStrategy(place={"encoder": "worker"})`` (``DropIn`` does the work). Each
placed module is trained over there by mirrors of the Lightning optimizers that hold its
parameters, group by group; ``trains={path: Split(Adam, lr=...)}`` (or an optimizer
factory) chooses the optimizer over there for that module instead.

    route = PlacedRoute.open(strategy, trainer, {"encoder": Split(Adam, lr=1e-3)}, session)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from .._errors import Refused
from ..torch._session import Session
from ._dropin import DropIn
from ._private import lightning_optimizers
from ._route import Route


class PlacedRoute(Route):
    """The placed submodules of one LightningModule (one ``DropIn``, the part ``""`` of
    the fit's session)."""

    def __init__(self, dropin: DropIn):
        self.dropin = dropin
        self.closed = False

    @override
    @classmethod
    def names(cls, strategy: Any, model: Any) -> list[str]:
        return list(strategy.place)

    @override
    @classmethod
    def open(cls, strategy: Any, trainer: Any, trains: Mapping[str, Any],
             session: Session) -> PlacedRoute | None:
        if not strategy.place:
            return None
        if trains and trainer.training and (
                trainer.gradient_clip_val or getattr(strategy.precision_plugin, "scaler", None)):
            raise Refused(
                "SomatizeStrategy(place=..., trains=...) with gradient clipping or a loss "
                "scaler: the optimizer you chose over there sees neither the norm nor the "
                "scale. Drop trains= (mirrors of your optimizers clip and unscale as one piece "
                "would), or train without them")
        dropin = DropIn(strategy.lightning_module, strategy.place, strategy.optimizers,
                        session, lightning_optimizers(strategy),
                        strategy.precision_plugin, strategy.root_device, trains=trains,
                        schedulers=[c.scheduler for c in strategy.lr_scheduler_configs])
        dropin.fitting(trainer.training)
        return cls(dropin)

    @override
    def part_of(self, name: str) -> str | None:
        return "" if name in self.dropin.modules else None

    @property
    @override
    def trains(self) -> bool:
        return True  # what trains over there is known only as optimizers step

    @override
    def before_step(self) -> None:
        if not self.closed:
            self.dropin.check()  # an in-place compile() since the last step: refused now

    @override
    def optimizer_stepped(self, optimizer: Any) -> None:
        if not self.closed:
            self.dropin.stepped(optimizer)

    @override
    def bring_weights_here(self) -> None:
        if not self.closed:  # after fit: brought here, with the optimizers' states, at close
            self.dropin.sync()

    @override
    def state_out(self, checkpoint: dict[str, Any]) -> None:
        if not self.closed and self.dropin.chosen:
            checkpoint.setdefault("somatize", {})["chosen"] = self.dropin.chosen_states()

    @override
    def state_in(self, checkpoint: Mapping[str, Any]) -> None:
        if self.closed:
            return
        self.dropin.load_optimizer_states(list(checkpoint.get("optimizer_states", [])))
        self.dropin.load_chosen_states(checkpoint.get("somatize", {}).get("chosen", {}))

    @override
    def optimizer_state(self, optimizer: Any, state: dict) -> dict:
        if self.closed:  # after fit the optimizers here hold what the mirrors held
            return state
        return self.dropin.optimizer_state(optimizer, state)

    @override
    def settle(self) -> None:
        if not self.closed:
            self.dropin.settle()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt) and not self.closed:
            self.dropin.interrupt()  # teardown asks nothing of the workers; says what is lost

    @override
    def close(self, pull: bool) -> None:
        if not self.closed:
            self.closed = True
            self.dropin.close(pull=pull)
