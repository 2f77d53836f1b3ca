"""``SomatizeStrategy``: a Lightning strategy that runs, and trains, parts of a
LightningModule on workers; the rest runs here as it always did.

    trainer = lightning.Trainer(strategy=SomatizeStrategy(place={"encoder": "worker"}))
    trainer = lightning.Trainer(strategy=SomatizeStrategy())   # or strategy="somatize"
    trainer.fit(model)   # model holds GraphModule(Graph.somatize(Body().at("worker") >> Head()))

Two routes do the work (``_route.py``), each asked the same questions in turn: the
placed route (submodules named in ``place=``, ``_placed_route.py``) and the graph route
(GraphModules whose nodes are placed with ``.at(...)``, ``_graph_route.py``). A model may
use both. Both stand on one ``Session`` per fit (``somatize/torch/_session.py``): the
account of what ran where, the traffic, a Ctrl-C and the close are the session's.
Workers are ``somatize.remote``'s: embedded (started here on loopback) when
none are given, standing with ``workers={"worker": Worker.at("node3:7000")}``, and under
torchrun ranks >= 1 serve (``_launcher.py``) and exit 0 when the coordinator is done.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from typing_extensions import override

from .. import _trace
from .._errors import Refused, WorkerError
from .._trace import span
from ..torch._session import Session, Traffic, lost_error, refuse_devices
from ..torch._tracer import Tracer
from ..torch.graph._refuse import refuse_unknown
from ._callback import graph_modules
from ._epoch_end import _EpochEnd
from ._graph_route import GraphRoute
from ._launcher import _ServingLauncher
from ._placed_route import PlacedRoute
from ._private import devices_asked, parallel_devices, set_launcher, set_root_device
from ._route import Route
from ._study_route import StudyRoute
from ._workers import (
    check_place,
    check_rng,
    check_workers,
    refuse_unused_workers,
    warm_up,
    with_store,
)

log = logging.getLogger(__name__)

ROUTES: tuple[type[Route], ...] = (StudyRoute, PlacedRoute, GraphRoute)  # asked in this order
_RESUME = "The last checkpoint written is the point to resume from: fit(ckpt_path=...)"


class SomatizeStrategy(SingleDeviceStrategy):
    """Run parts of a LightningModule, and train them, on workers.

    Args:
        place: ``{submodule path: worker}``: the placed route. The named submodules of
            an unmodified LightningModule (``"encoder"``, ``"model.transformer"``) run and
            train on those workers; nothing in the model changes. ``{"trunk": study.shared}``
            runs it on a study's hub, shared with other data owners (``somatize.fed``).
        trains: what trains a part over there, instead of a mirror of the Lightning
            optimizer that holds its parameters (same class, hyper-parameters and groups,
            stepped when it steps). Keyed by a placed module's path (``place=``) or a
            GraphModule node's id: ``{"encoder": Split(Adam, lr=1e-3)}`` or an optimizer
            factory (``functools.partial(SGD, lr=0.1)``), a ``Learning`` for a node. What
            it names is trained by that alone, over there; parts it does not name are
            mirrored. A name that is neither is refused.
        workers: ``{host: Worker}`` (``Worker.at("node3:7000")`` for a standing worker,
            ``Worker.embedded(store=...)`` for one that keeps what it runs); hosts not
            given get an embedded worker, or under torchrun the rank that serves them.
        store: a directory the embedded workers keep what they run in (a graph node's
            remembered values over there); a worker given in ``workers=`` keeps its own.
            The cache of a LightningModule's own modules is ``SomatizeCache(store)``.
        trace: a path: write a Chrome trace-event file of the run there (Perfetto,
            chrome://tracing): one lane per process, spans for each forward and backward,
            transfer (with its bytes), optimizer step and wait; written at teardown.
        rng: what the placed modules' randomness over there draws from, on every worker
            not given as a ``Worker`` (which says its own): ``"sent"`` (this process's
            RNG state travels with each call) or ``"derived"`` (none crosses; a generator
            derived per call from ``rng_key``), as ``Worker(rng=...)`` says. On the Hydra
            line: ``somatize.rng=derived``.
        rng_key: the key ``rng="derived"`` seeds derive from.
    """

    strategy_name = "somatize"

    def __init__(self, trains: Mapping[str, Any] | None = None, workers: Any = None,
                 store: Any = None, place: Mapping[str, str] | None = None,
                 trace: str | os.PathLike | None = None, rng: str = "sent",
                 rng_key: str = "somatize", **kwargs: Any):
        super().__init__(device=torch.device("cpu"), **kwargs)  # Lightning's, at setup
        check_place(place)
        check_workers(workers)
        self.rng, self.rng_key = check_rng(rng, rng_key)
        # a study's shared module (place={"trunk": study.shared}) runs on its hub
        self.shared = {k: v for k, v in (place or {}).items() if hasattr(v, "somatize_study")}
        self.place = {k: v for k, v in (place or {}).items() if k not in self.shared}
        self.trace = trace
        self._tracer: Tracer | None = None
        self._lost: str | None = None  # a worker lost with trained state: nothing to save
        self.trains = dict(trains or {})
        self.workers = dict(workers) if workers else None
        if store is not None and not isinstance(store, (str, os.PathLike)):
            raise Refused(f"SomatizeStrategy(store={type(store).__name__}): the embedded "
                          "workers are other processes and open a store by its directory: "
                          "give a path (str or pathlib.Path)")
        self.store = None if store is None else os.fspath(store)
        self.routes: list[Route] = []
        self._session: Session | None = None  # the fit's (kept after it: where(), traffic())
        self._broken = self._interrupted = False

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        warm_up(self.place, self.workers, graph_modules(model))

    @override
    def setup_environment(self) -> None:
        # the local half on Lightning's root device (accelerator="gpu" gives cuda:N)
        trainer = self.lightning_module.trainer if self.lightning_module else None
        devices = parallel_devices(trainer) if trainer is not None else None
        if devices:
            set_root_device(self, torch.device(devices[0]))
        super().setup_environment()

    @override
    def _configure_launcher(self) -> None:
        set_launcher(self, _ServingLauncher(self))

    def _killed(self) -> None:
        self._broken = True
        self.close()

    def close(self) -> None:
        """End this strategy's session on its workers (the worker processes are shared
        and stop when nobody uses them, or at exit)."""
        if self._session is not None:
            self._session.close()

    # -- setup ------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # Lightning quietly drops a single-device strategy to one device: read what was asked
        asked = devices_asked(trainer)
        wanted = (len(asked) if isinstance(asked, (list, tuple))
                  else int(asked) if str(asked).isdigit() else 1)
        refuse_devices(asked, max(wanted, trainer.num_devices), trainer.num_nodes)
        if self.trace is not None and self._tracer is None:
            self._tracer = Tracer(self.trace)
        super().setup(trainer)
        model = self.lightning_module
        if self._lost:
            log.warning("a worker was lost with what it trained (%s): this run starts from the "
                        "copy here; resume from the last checkpoint to continue the lost run",
                        self._lost)
            self._lost = None
        # a new fit: a worker lost (or Ctrl-C) in the last one is gone
        self._broken = self._interrupted = False
        old, self.routes = self.routes, []
        for route in old:  # a fit that ended without teardown (an exception in setup)
            route.close(pull=False)
        names = {kind: kind.names(self, model) for kind in ROUTES}
        refuse_unknown(self.trains, GraphRoute.names(self, model), self.place)
        refuse_unused_workers(self.workers, self.place, graph_modules(model))
        # the new session first: the worker processes of the old one are reused
        last, self._session = self._session, Session(
            workers=with_store(self.workers, self.store, self.place, graph_modules(model)),
            restart="run the fit again (it starts fresh workers)")
        try:
            for kind in ROUTES:
                mine = {n: t for n, t in self.trains.items() if n in names[kind]}
                route = kind.open(self, trainer, mine, self._session)
                if route is not None:
                    self.routes.append(route)
        except BaseException:
            opened, self.routes = self.routes, []  # teardown finds nothing left to close
            for route in opened:  # what opened gives the modules their forward back
                route.close(pull=False)
            self._session.close()
            raise
        finally:
            if last is not None:
                last.close()
        if not any(isinstance(c, _EpochEnd) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _EpochEnd())  # before the user's own
        if self._tracer is not None:
            for runtime in self._session.runtimes():
                self._tracer.add(runtime)
        if not self.routes:
            log.warning(
                "SomatizeStrategy places nothing: every module of %s runs here, as under "
                "Lightning's own strategy. Name what runs on a worker with "
                "SomatizeStrategy(place={'encoder': 'worker'}), or .at('worker') on a node "
                "of a GraphModule", type(model).__name__)

    # -- what ran where -----------------------------------------------------------------
    def where(self) -> dict[str, dict[int, int]]:
        """Which processes ran each placed module and each placed node, and how often (one
        call a forward, however it trains): ``{name: {pid: times}}``, a placed module under
        its path (``"encoder"``), a GraphModule's node under the GraphModule's path and the
        node's id (``"net.body"``); the worker's pid for what ran over there."""
        if self._session is None:
            return {}
        return {(f"{part}.{name}" if part else name): pids
                for part, ran in self._session.where().items() for name, pids in ran.items()}

    def _say_where(self) -> None:
        """Log where each placed module and node ran, once a fit is over (INFO, one line
        each: the user's account of the fit, outside the progress bar)."""
        hosts = dict(self.place)
        for route in self.routes:
            for name, gm in getattr(route, "modules", {}).items():
                if isinstance(route, GraphRoute):
                    for node in gm.graph.ids:
                        if gm.graph.placement.get(node):
                            hosts[f"{name}.{node}"] = gm.graph.placement.get(node)
        me = os.getpid()
        for name, pids in self.where().items():
            if pids:
                log.info("module %r ran in %s", name, ", ".join(
                    f"process {pid} ({'here' if pid == me else f'worker {hosts.get(name)!r}'}) "
                    f"{times} times" for pid, times in pids.items()))

    def traffic(self) -> Traffic:
        """What this fit moved so far: ``Traffic(waited, sent, received)``, the seconds this
        process waited on workers and the bytes sent and received (a tuple too)."""
        return Traffic() if self._session is None else self._session.traffic()

    def session(self, name: str | None = None) -> Any:
        """The fit's ``Session`` (every part over there, its traffic and where it ran),
        None before the fit. A part by name is ``part(name)``."""
        if name is not None:
            raise TypeError(f"session({name!r}): a part of the session is "
                            f"strategy.part({name!r}); session() is the whole fit's")
        return self._session

    def part(self, name: str) -> Any:
        """The part of the fit's session that runs ``name`` (a placed module's path, or a
        GraphModule's name in the LightningModule): ``part(name).call(host, fn, *args)``
        runs ``fn(live_graph, *args)`` over there. None when nothing placed runs it (or
        the fit's run over there is over)."""
        if self._session is None:
            return None
        for route in self.routes:
            part = route.part_of(name)
            if part is not None:
                return self._session.part(part)
        return None

    def sync(self) -> None:
        """Bring the weights trained over there here (during fit the copy here is stale
        until an epoch ends, validation starts or a checkpoint is written)."""
        self._refuse_lost()
        if self._broken:
            return
        try:
            for route in self.routes:
                route.bring_weights_here()
        except WorkerError as e:
            raise self._lose(e) from None

    # -- a training step ----------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        for route in self.routes:
            route.before_step()
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        # Strategy.backward, with the backward past the cut before on_after_backward
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args,
                                       **kwargs)
        for route in self.routes:
            route.after_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        tracing = _trace.current()
        if tracing is None:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:  # the closure (forward, backward) inside optimizer.step, told apart from it
            done: list[float] = []

            def traced() -> Any:
                with span("training step (forward, backward)", "step"):
                    got = closure()
                done.append(_trace.now_us())
                return got

            out = super().optimizer_step(optimizer, traced, model, **kwargs)
            if done:
                tracing.add("optimizer step here", "step", done[-1], _trace.now_us() - done[-1])
        for route in self.routes:
            route.optimizer_stepped(optimizer)
        return out

    # -- weights and checkpoints --------------------------------------------------------
    def _lose(self, e: WorkerError) -> WorkerError:
        """Remember that trained state was lost with a worker; the error that says so."""
        self._broken, self._lost = True, str(e).splitlines()[0]
        return lost_error(self._lost, _RESUME)

    def _refuse_lost(self) -> None:
        if self._lost:
            raise lost_error(self._lost, _RESUME)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.sync()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if not self._broken:
            for route in self.routes:
                state = route.optimizer_state(optimizer, state)
        return state

    @override
    def on_validation_start(self) -> None:
        self.sync()  # what a callback reads during validation is what was trained
        super().on_validation_start()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        self._refuse_lost()
        if not self._broken:
            try:
                for route in self.routes:
                    route.state_out(checkpoint)
            except WorkerError as e:
                raise self._lose(e) from None
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        for route in self.routes:
            route.state_in(checkpoint)

    @override
    def on_exception(self, exception: BaseException) -> None:
        for route in self.routes:
            route.on_exception(exception)
        if isinstance(exception, KeyboardInterrupt) and self._session is not None:
            self._broken = True  # teardown asks nothing of the workers, and waits for none
            self._interrupted = True  # but writes the trace of what ran here
            self._session.abort("it was stopped when this process was interrupted (Ctrl-C)")
        if isinstance(exception, WorkerError):
            self._broken = True
            if any(route.trains for route in self.routes):
                # what was trained over there since the last checkpoint is gone with it
                self._lost = str(exception).splitlines()[0]
                exception.add_note(f"Under SomatizeStrategy: {_RESUME}")

    @override
    def teardown(self) -> None:
        pull = not self._lost and not self._broken
        if self._tracer is not None and (self._interrupted or not self._broken):
            if not self._broken:
                for route in self.routes:
                    route.settle()
            self._tracer.write()  # the stopped workers' spans are gone with them
        fitted = any(getattr(r, "fitting", False) for r in self.routes) and not self._broken
        for route in self.routes:
            route.close(pull=pull)  # where() stays readable after fit
        if fitted:
            self._say_where()
        if self._broken:
            self.close()  # a dead worker: nothing over there to keep a session for
        super().teardown()


if "somatize" not in StrategyRegistry:
    StrategyRegistry.register("somatize", SomatizeStrategy,
                              description="runs and trains parts of a LightningModule on "
                                          "workers (somatize)")
