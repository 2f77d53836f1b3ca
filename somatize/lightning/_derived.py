"""Randomness in a placed module that no RNG state of this process decides: each call of
the module draws from a generator seeded by ``HMAC(key, path/stage/global step/batch/
dataloader/call)``, the call counted from the batch's start. ``Worker(rng="derived")``
seeds the placed module's calls so over there (nothing of this process's RNG crosses);
``DerivedRNG`` does the same in one piece: the oracle such a run equals bit for bit.

    oracle = pl.Trainer(callbacks=[DerivedRNG(["encoder"], key="run-7")])   # one piece
    placed = pl.Trainer(strategy=SomatizeStrategy(place={"encoder": "bank"}, workers={
        "bank": Worker.at("bank.example.org:7000", rng="derived", rng_key="run-7")}))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from .._errors import Refused
from ..torch._seeds import derived_seed, seeded
from ._quiet import Quiet


class DerivedRNG(Quiet):
    """Each call of the modules at ``paths`` draws from a generator derived from ``key``
    and where the call stands (stage, global step, batch, dataloader, its number in the
    batch), the caller's RNG state put back after it: in one piece (the default
    strategy), what ``Worker(rng="derived", rng_key=key)`` gives a placed module.

    Args:
        paths: the submodules, as ``place=`` names them (``["encoder"]``), or
            ``{path: key}`` for a key per module.
        key: the key the seeds derive from (``Worker``'s ``rng_key``).
    """

    def __init__(self, paths: Iterable[str] | Mapping[str, str], key: str = "somatize"):
        self.keys = (dict(paths) if isinstance(paths, Mapping)
                     else {p: key for p in paths})
        self.wraps = True  # one piece: the modules' forward here draws; placed: the Links'
        self.at: tuple = ("outside", 0, 0, 0)
        self.calls = dict.fromkeys(self.keys, 0)
        self.wrapped: list[tuple[torch.nn.Module, Any]] = []

    def seed(self, path: str) -> int:
        """The seed of ``path``'s next call (counted)."""
        n = self.calls[path]
        self.calls[path] = n + 1
        return derived_seed(self.keys[path], path, *self.at, n)

    def _start(self, trainer: pl.Trainer, batch_idx: int, dataloader_idx: int = 0) -> None:
        stage = trainer.state.stage
        self.at = (getattr(stage, "value", stage), trainer.global_step, batch_idx,
                   dataloader_idx)
        self.calls = dict.fromkeys(self.keys, 0)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start(trainer, batch_idx)

    @override
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx,
                                  dataloader_idx=0):
        self._start(trainer, batch_idx, dataloader_idx)

    @override
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(trainer, batch_idx, dataloader_idx)

    @override
    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx,
                               dataloader_idx=0):
        self._start(trainer, batch_idx, dataloader_idx)

    # -- one piece: the modules' own forward, seeded ------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.wraps or self.wrapped:
            return
        for path in self.keys:
            try:
                m = pl_module.get_submodule(path)
            except AttributeError:
                raise Refused(f"DerivedRNG names {path!r}, which is not a submodule of "
                              f"{type(pl_module).__name__}: give paths as place= does") from None
            own = m.__dict__.get("forward")
            forward = m.forward

            def drawn(*args: Any, _path: str = path, _forward: Any = forward,
                      _m: torch.nn.Module = m, **kwargs: Any) -> Any:
                p = next(_m.parameters(), None)
                with seeded(self.seed(_path), None if p is None else p.device):
                    return _forward(*args, **kwargs)

            m.forward = drawn
            self.wrapped.append((m, own))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                 stage: str) -> None:
        for m, own in self.wrapped:
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own
        self.wrapped = []


def derived_draws(workers: Mapping[str, Any] | None, place: Mapping[str, str],
                  rng: str = "sent", rng_key: str = "somatize") -> DerivedRNG | None:
    """The draws of the placed modules whose worker says ``rng="derived"``, or, for a
    worker not given as a ``Worker``, whose strategy does (``rng``, ``rng_key``); None:
    every placed module's calls carry this process's RNG state."""
    keys = {}
    for path, host in place.items():
        spec = (workers or {}).get(host)
        said, key = (spec.rng, spec.rng_key) if hasattr(spec, "rng") else (rng, rng_key)
        if said == "derived":
            keys[path] = key
    if not keys:
        return None
    draws = DerivedRNG(keys)
    draws.wraps = False
    return draws
