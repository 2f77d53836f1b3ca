"""``SomatizeCache``: the Lightning callback that keeps frozen modules' outputs in a
store. Named by path (``modules=["body"]``) on any LightningModule: the module is
frozen, and its calls are answered from the store when their output is kept there,
here or on the worker it is placed on. On the graph route it settles what a graph
declares ``.frozen()`` and checks the prefix rule before the first batch.

    trainer = lightning.Trainer(callbacks=[SomatizeCache("/scratch/soma", modules=["body"])])
    trainer = lightning.Trainer(callbacks=[SomatizeCache(store="/scratch/soma")])  # graphs
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from .._errors import Refused
from .._memory import cacheable
from ..torch import GraphModule, freeze
from ..torch.cache._cached import CachedForward, counts_there
from ._cache_counts import Counting, StageCounts, shuffles
from ._quiet import Quiet

log = logging.getLogger(__name__)


def graph_modules(module: Any) -> list[GraphModule]:
    """Every ``GraphModule`` inside a LightningModule."""
    return [m for m in module.modules() if isinstance(m, GraphModule)]


class SomatizeCache(Quiet):
    """Keep frozen modules' outputs in a store; settle frozen nodes of graphs.

    ``modules=["body"]`` names submodules of the LightningModule (paths as
    ``get_submodule`` takes them). Each is frozen when the trainer sets up (no gradients,
    eval mode, a digest of its state) and its calls are named by its class, that digest
    and the call's input: a call whose name is in the store is answered from there.
    Placed on a worker (``SomatizeStrategy(place=...)``), it does the same over there,
    with the same store path (on another machine, a path both see). Refused before the
    first batch: a path that is not a submodule, a store that is not a directory for a
    placed module, and an optimizer holding a cached module's parameter; at its first
    call, a cached module whose input asks for a gradient (it comes from something that
    still trains, and a value read from the store sends none back).

    A call's name covers what changes the output: the module's state (non-persistent
    buffers too), the settings of it and its children (``eps``, a scale: an attribute
    that cannot be named is refused at setup, naming it), ``salt`` and the call's
    autocast state; the code of every class in its tree is kept beside the value.

    With ``per_item=True`` each module promises that each output row depends only on its
    input row (dim 0): its calls are answered item by item under the same name's pieces
    (see ``docs/per-item.md``), so shuffled batches hit from the second epoch on. A layer
    that couples rows (BatchNorm in train mode, or without running statistics) is
    refused at setup, naming it.

    Hits and misses are logged each epoch, per stage (``cache/hits``, ``cache/misses``
    for training, ``cache/val_hits``, ``cache/test_hits``...; in items with
    ``per_item=True``); their totals are kept in checkpoints. A store path that is an
    existing file is refused at setup.

    Args:
        store: a directory (created if missing) or a Keeper where cached outputs are kept.
        modules: the submodules whose outputs are kept, by path.
        salt: a string in every name: change it when something the key cannot see
            changes what the modules compute (an attribute holding an object is then
            left out of the name instead of refused).
        per_item: keep and look up each module's output row by row (a store directory).
        exact: with ``per_item``, refuse when a row's kept value would differ from what
            computing its batch again gives (see docs/per-item.md).
    """

    def __init__(self, store: str | PathLike | Any, modules: Sequence[str] = (),
                 salt: str | None = None, per_item: bool = False, exact: bool = False):
        self.store = store
        self.exact = exact
        self.modules = list(modules)
        self._said_frozen = False
        self.salt = salt
        self.per_item = per_item
        self.stages = StageCounts()  # hits and misses by stage (train, val, test, predict)
        self.keeper: Counting | None = None
        self.cached: dict[str, CachedForward] = {}  # by path: what each module now calls
        self.hits = 0  # totals over every epoch of training and validation, resumed
        self.misses = 0
        self._trainer: pl.Trainer | None = None

    def _attach(self, pl_module: pl.LightningModule) -> None:
        if self.keeper is None:
            from ..store import open_keeper

            self.keeper = Counting(open_keeper(self.store))
        for gm in graph_modules(pl_module):
            gm.store = self.keeper

    def _settle(self, pl_module: pl.LightningModule) -> None:
        for gm in graph_modules(pl_module):
            freeze(gm.graph)  # again after a checkpoint's weights were restored: a new digest
            if gm.graph.memory.cached:
                cacheable(gm.graph)
            gm.train(gm.training)  # frozen nodes back to eval mode
        for cached in self.cached.values():
            cached.module.eval()
            cached.settle()

    # -- the modules named by path ------------------------------------------------------
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        place = dict(getattr(trainer.strategy, "place", None) or {})
        names = [n for n, _ in pl_module.named_modules() if n]
        for path in self.modules:
            try:
                module = pl_module.get_submodule(path) if path else None
            except AttributeError:
                module = None
            if module is None:
                near = difflib.get_close_matches(path, names, n=5) or names[:8]
                raise Refused(
                    f"SomatizeCache(modules=[{path!r}]): {type(pl_module).__name__} has no "
                    f"submodule {path!r}; its submodules include {near}. Give paths as "
                    "get_submodule takes them ('body', 'model.encoder')")
            inside = [o for o in self.modules if o != path and path.startswith(o + ".")]
            if inside:
                raise Refused(f"SomatizeCache(modules=...) names {inside[0]!r} and {path!r}, "
                              "which is inside it: cache one")
            host = _placed_on(place, path)
            if host is not None and not isinstance(self.store, (str, PathLike)):
                raise Refused(
                    f"module {path!r} is cached and placed on worker {host[0]!r}: its outputs "
                    f"are kept over there, which a {type(self.store).__name__} given here "
                    "cannot reach. Give SomatizeCache a directory path the worker can reach "
                    "(on another machine, a shared one)")
            for p in module.parameters():
                p.requires_grad_(False)
            module.eval()
            have = module.__dict__.get("forward")
            if type(have) is _forward_class(self.per_item):  # left by an earlier fit
                have.active = True
                have.settle()
                self.cached[path] = have
            else:
                self.cached[path] = _forward_class(self.per_item)(
                    module, path, self.store, previous=have, salt=self.salt,
                    **({"exact": True} if self.exact else {}))
                module.forward = self.cached[path]  # an instance attribute: it pickles along
        if self.cached and not self._said_frozen:  # once: a test after the fit says nothing new
            self._said_frozen = True
            log.info("modules %s are frozen; their outputs are kept in %s", sorted(self.cached),
                     self.store)

    def _uninstall(self) -> None:
        for cached in self.cached.values():
            # off wherever it is: after an exception the strategy gives it back to the
            # module only after this callback has run
            cached.active = False
            if cached.module.__dict__.get("forward") is cached:
                del cached.module.__dict__["forward"]
                if cached.previous is not None:
                    cached.module.forward = cached.previous
        self.cached.clear()

    def _refuse_trained(self, trainer: pl.Trainer) -> None:
        for path, cached in self.cached.items():
            mine = {id(p): n for n, p in cached.module.named_parameters()}
            for i, opt in enumerate(trainer.optimizers):
                held = [mine[id(p)] for g in opt.param_groups for p in g["params"]
                        if id(p) in mine]
                if held:
                    raise Refused(
                        f"module {path!r} is cached by SomatizeCache, so frozen, but optimizer "
                        f"{i} ({type(opt).__name__}) holds its parameter {path}.{held[0]}: "
                        "a cached output is right only while the module does not change. "
                        "Build the optimizer over what still trains, e.g. "
                        "SGD([p for p in self.parameters() if p.requires_grad], ...) in "
                        f"configure_optimizers, or leave {path!r} out of modules=")

    # -- hooks ----------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # before the optimizers are built (so frozen weights are not handed to them) and
        # before the strategy sends placed modules to their workers (the cache goes along)
        self._trainer = trainer
        _refuse_file(self.store)
        self._install(trainer, pl_module)
        self._settle(pl_module)
        self._attach(pl_module)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        for cached in self.cached.values():
            cached.settle()  # the checkpoint's weights: a new digest

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(pl_module)
        self._refuse_trained(trainer)
        self._own_eval_mode(pl_module)

    def _own_eval_mode(self, pl_module: pl.LightningModule) -> None:
        """Lightning warns of modules in eval mode at the start of training: when those
        are the cached ones, which this callback froze, the warning is ours, and said here."""
        frozen = {n for n, m in pl_module.named_modules()
                  if not m.training and any(n == c or n.startswith(c + ".")
                                            for c in self.cached)}
        others = [n for n, m in pl_module.named_modules() if not m.training and n not in frozen]
        if frozen and not others:
            warnings.filterwarnings(
                "ignore", message=re.escape(f"Found {len(frozen)} module(s) in eval mode at "
                                            "the start of training."))
            log.info("the cached modules %s are in eval mode (frozen: the outputs kept are "
                     "their eval outputs); Lightning's 'module(s) in eval mode' warning is "
                     "about them", sorted(self.cached))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.cached:
            said = "items" if self.per_item else "calls"
            log.info("SomatizeCache: modules %s computed their output for %d %s and read it "
                     "from the store %s for %d", sorted(self.cached), self.misses, said,
                     self.store, self.hits)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cached in self.cached.values():
            cached.module.eval()  # should anything have called .train() on the model
        self.stages.begin("train", self._counts())

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hits, misses = self._end_stage("train", pl_module)
        self._say_why_nothing_hit(trainer, hits, misses)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer,
                                  pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:  # Lightning's dry run: not counted, as not logged
            self.stages.begin("val", self._counts())

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._end_stage("val", pl_module)

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stages.begin("test", self._counts())

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_stage("test", pl_module)

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stages.begin("predict", self._counts())

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_stage("predict", None)  # Lightning takes no logged values in predict

    def _end_stage(self, stage: str, pl_module: pl.LightningModule | None) -> tuple[int, int]:
        """Count what this stage found and computed since it began, and log it."""
        hits, misses = self.stages.end(stage, self._counts())
        if stage in ("train", "val"):  # the totals of a fit, kept in checkpoints
            self.hits, self.misses = self.hits + hits, self.misses + misses
        prefix = "" if stage == "train" else f"{stage}_"
        if pl_module is not None:
            pl_module.log_dict({f"cache/{prefix}hits": float(hits),
                                f"cache/{prefix}misses": float(misses)},
                               on_epoch=True, on_step=False)
        where = f"epoch {self._trainer.current_epoch}" if self._trainer else "epoch"
        # per epoch at DEBUG: INFO would print into the progress bar; on_fit_end sums it
        log.debug("%s %s: %d cached outputs found, %d computed", stage, where, hits, misses)
        return hits, misses

    def _say_why_nothing_hit(self, trainer: pl.Trainer, hits: int, misses: int) -> None:
        """A whole-batch cache that found nothing after the first epoch under a shuffling
        loader: no batch repeats, so none ever will. Said once."""
        if hits or not misses or trainer.current_epoch < 1 or self.stages.said_shuffle:
            return
        if self.per_item:  # items never seen again: the input changes from epoch to epoch
            self.stages.said_shuffle = True
            log.warning(
                "SomatizeCache: epoch %d found none of its %d items in the store, which grew "
                "by as many rows: the inputs of %s are new every epoch (random augmentation "
                "before the cached module, most likely), so nothing kept is ever read again. "
                "Cache the module's output before the augmentation, or leave it uncached",
                trainer.current_epoch, misses, sorted(self.cached))
            return
        if not shuffles(trainer.train_dataloader):
            return
        self.stages.said_shuffle = True
        log.warning(
            "SomatizeCache: epoch %d found none of its %d outputs in the store: the train "
            "loader shuffles, so no batch repeats and a cache named by the whole batch never "
            "hits. Name each item instead: SomatizeCache(..., per_item=True) (.mapped() on a "
            "graph), for modules whose output rows depend only on their own input row; or "
            "turn shuffling off", trainer.current_epoch, misses)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()  # the module's own forward back (frozen it stays)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._uninstall()

    def _counts(self) -> tuple[int, int]:
        k = self.keeper
        hits, misses = (k.hits, k.misses) if k is not None else (0, 0)
        if self._trainer is not None and self._trainer.lightning_module is not None:
            h, m = _item_counts(self._trainer.lightning_module)
            hits, misses = hits + h, misses + m
        for path, cached in self.cached.items():
            h, m = self._counts_of(path, cached)
            hits, misses = hits + h, misses + m
        return hits, misses

    def _counts_of(self, path: str, cached: CachedForward) -> tuple[int, int]:
        """Where the module runs: read here, or over there through the strategy."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        where = _placed_on(getattr(strategy, "place", None) or {}, path)
        session = strategy.part(where[1]) if where is not None else None
        if session is None:
            return cached.hits, cached.misses
        host, placed = where
        inside = path[len(placed) + 1:]
        return tuple(session.call(host, counts_there, placed, inside))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "store": str(self.store)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.hits = state_dict["hits"]
        self.misses = state_dict["misses"]
        if state_dict.get("store") != str(self.store):
            log.info("resuming with store %s (the checkpoint was written with %s)",
                     self.store, state_dict.get("store"))


def _refuse_file(store: Any) -> None:
    """A store path that is, or lies under, an existing file, refused naming it."""
    if not isinstance(store, (str, PathLike)):
        return
    path = os.path.abspath(store)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise Refused(
            f"SomatizeCache(store={str(store)!r}): {path} is a file, not a directory, so "
            "nothing could be kept there. Give a directory path (it is created if missing), "
            "or move the file")


def _forward_class(per_item: bool) -> type[CachedForward]:
    """What a module named by path calls: item by item, or by its whole input."""
    if per_item:
        from ..torch.cache._per_item import PerItemForward

        return PerItemForward
    return CachedForward


def _item_counts(pl_module: pl.LightningModule) -> tuple[int, int]:
    """``(hits, misses)`` in items of the ``.mapped()`` nodes of its graphs, run here."""
    from ..torch.cache._per_item import mapped_counts

    hits = misses = 0
    for gm in graph_modules(pl_module):
        h, m = mapped_counts(gm.graph)
        hits, misses = hits + h, misses + m
    return hits, misses


def _placed_on(place: Mapping[str, str], path: str) -> tuple[str, str] | None:
    """``(worker, placed path)`` when ``path`` is, or is inside, a placed module."""
    for placed, host in place.items():
        if path == placed or path.startswith(placed + "."):
            return host, placed
    return None
