"""The study route: an owner's ordinary Lightning fit whose shared module runs on a
study's hub (``somatize.fed``), ``SomatizeStrategy(place={"trunk": study.shared})``.
Each training step sends the activation at the cut and the gradient of the module's
output, nothing else (no RNG state, no weights, no code); each epoch is a round: the
owner's ``parts`` are averaged with the other owners' (FedAvg, weighted by rows); or a
round is the study's ``round_steps`` owner-steps.

    route = StudyRoute.open(strategy, trainer, {}, session)   # by SomatizeStrategy.setup
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from .._errors import Refused
from ..torch._session import Session
from ._placing import placed_modules
from ._quiet import Quiet
from ._route import Route

log = logging.getLogger(__name__)


class _Cut(torch.autograd.Function):
    """The shared module's forward and backward, run on the hub."""

    @staticmethod
    def forward(ctx: Any, route: StudyRoute, x: torch.Tensor) -> torch.Tensor:
        ctx.route = route
        return route.forward(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.route.backward(g)


class _Rounds(Quiet):
    """Attach when training starts (after a checkpoint is restored); end a round as
    each epoch ends, or after each ``round_steps`` owner-steps (the steps left at the
    fit's end a round of their own), before the other callbacks (a checkpoint holds
    the average)."""

    def __init__(self, route: StudyRoute):
        self.route = route
        self.every = route.cfg.round_steps

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every:  # an owner-step is an optimizer step (accumulate_grad_batches=1)
            self.route.attach(trainer.global_step // self.every, str(trainer.precision),
                              trainer.global_step % self.every)
        else:
            self.route.attach(trainer.current_epoch, str(trainer.precision))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.every and self.route.step >= self.every:
            self.route.round_end()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.every:
            self.route.round_end()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every and self.route.step:
            self.route.round_end()


class StudyRoute(Route):
    """One owner's shared module (``place={path: study.shared}``) for one fit."""

    def __init__(self, model: torch.nn.Module, path: str, study: Any, trainer: Any):
        self.model, self.path, self.study = model, path, study
        self.cfg = study.config
        self.module = placed_modules(model, {path: "hub"})[path]
        for part in self.cfg.parts:
            if part == path or part.startswith(path + "."):
                raise Refused(f"study {self.cfg.name!r} averages part {part!r}, which is the "
                              "shared module: it is the hub's and never comes here")
            model.get_submodule(part)  # AttributeError names a part that is not there
        self.link = study.link()
        self.averager = study.averager_link()  # None: the hub averages the parts
        self.rows = 0  # this round's, as the hub counts them (what the averager weighs)
        self.round = self.step = 0
        self.average_digest: str | None = None
        self.attached = self.checked = False
        self.precision = str(trainer.precision)
        self.pending: int | None = None
        self.callback = _Rounds(self)
        self.closed = False
        self.module.forward = self._forward_here  # what the model calls: the hub's module
        log.info("module %r runs on study %r's hub %s (schedule %s); its weights stay there",
                 path, self.cfg.name, study.hub, self.cfg.schedule)

    def _fields(self, **more: Any) -> dict:
        return {"study": self.cfg.name, "owner": self.study.owner, **more}

    @override
    @classmethod
    def names(cls, strategy: Any, model: Any) -> list[str]:
        return []  # the study trains its shared module: trains= names none of it

    @override
    @classmethod
    def open(cls, strategy: Any, trainer: Any, trains: Mapping[str, Any],
             session: Session) -> StudyRoute | None:
        shared = getattr(strategy, "shared", None)
        if not shared:
            return None
        if len(shared) > 1:
            raise Refused(f"place= names {sorted(shared)} as shared modules: a study shares "
                          "one module; place one")
        ((path, where),) = shared.items()
        if trainer.accumulate_grad_batches != 1 or trainer.gradient_clip_val:
            raise Refused("a study's shared module steps on the hub at every owner-step: "
                          "accumulate_grad_batches must be 1 and gradient_clip_val unset")
        route = cls(strategy.lightning_module, path, where.somatize_study, trainer)
        if trainer.training:
            trainer.callbacks.insert(0, route.callback)
        return route

    # -- the owner-step ----------------------------------------------------------------
    def _forward_here(self, x: Any, *rest: Any, **kw: Any) -> torch.Tensor:
        if rest or kw or not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise Refused(f"module {self.path!r} is shared through study {self.cfg.name!r}, "
                          "whose link carries one floating tensor in and one out")
        if not (torch.is_grad_enabled() and self.model.training):
            if not self.checked:  # validation before training starts, or a test after
                self.link.call("Attach", self._fields(
                    digest=self.cfg.digest(), precision=self.precision,
                    schedule=self.cfg.schedule, round=self.round, evaluate=True))
                self.checked = True
            _, _, t = self.link.call("Forward", self._fields(train=False), {"x": x})
            return t["y"]
        if not x.requires_grad:  # the cut's backward must run for the hub's step to end
            x = x.detach().requires_grad_(True)
        return _Cut.apply(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.attached:
            raise Refused(f"study {self.cfg.name!r}: a training forward before the fit "
                          "attached to the hub")
        if self.pending is not None:
            raise Refused(f"study {self.cfg.name!r}: a second forward of {self.path!r} in "
                          f"step {self.pending} before its backward; a shared module runs "
                          "once per training step")
        _, _, t = self.link.call("Forward", self._fields(round=self.round, step=self.step,
                                                         train=True), {"x": x},
                                 timeout=self.study.timeout + self.cfg.round_timeout)
        self.pending = self.step
        self.pending_rows = int(x.shape[0]) if x.dim() else 1
        return t["y"]

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        _, _, t = self.link.call("Backward", self._fields(step=self.pending),
                                 {"g": g.contiguous()})
        self.pending = None
        self.step += 1
        self.rows += self.pending_rows
        return t["gx"]

    # -- rounds -------------------------------------------------------------------------
    def attach(self, round: int, precision: str, step: int = 0) -> None:
        _, fields, _ = self.link.call("Attach", self._fields(
            digest=self.cfg.digest(), precision=precision, schedule=self.cfg.schedule,
            round=round))
        self.round, self.step, self.attached = round, step, True
        self.checked = True

    def round_end(self) -> None:
        parts = {}
        for part in self.cfg.parts:
            parts.update({f"{part}.{k}": v for k, v in
                          self.model.get_submodule(part).state_dict().items()})
        wait = self.study.timeout + self.cfg.round_timeout
        _, fields, avg = self.link.call("RoundEnd", self._fields(round=self.round),
                                        {} if self.averager else parts, timeout=wait)
        if self.averager is not None:  # the parts go to the study's averager, never the hub
            _, fields, avg = self.averager.call("RoundEnd", self._fields(
                round=self.round, rows=self.rows, owners=fields["owners"],
                digest=self.cfg.digest()), parts, timeout=wait)
        for part in self.cfg.parts:
            pre = part + "."
            self.model.get_submodule(part).load_state_dict(
                {k[len(pre):]: v for k, v in avg.items() if k.startswith(pre)})
        self.average_digest = fields.get("digest")
        self.round, self.step, self.rows = self.round + 1, 0, 0

    # -- what the strategy asks ----------------------------------------------------------
    @override
    def part_of(self, name: str) -> str | None:
        return None

    @property
    @override
    def trains(self) -> bool:
        return False  # what trains on the hub is the hub's: a lost hub loses nothing here

    @override
    def bring_weights_here(self) -> None:
        return None  # the shared module's weights are the hub's; they never come here

    @override
    def state_out(self, checkpoint: dict[str, Any]) -> None:
        checkpoint.setdefault("somatize", {})["study"] = {
            "study": self.cfg.name, "round": self.round, "digest": self.cfg.digest(),
            "average": self.average_digest}

    @override
    def close(self, pull: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.module.__dict__.pop("forward", None)
        self.link.close()
        if self.averager is not None:
            self.averager.close()
