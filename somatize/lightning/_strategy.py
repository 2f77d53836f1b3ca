"""``SomatizeStrategy``: a Lightning strategy that honours a graph's placement — the
placed nodes run, and train, on workers; the rest runs here as it always did.

    trainer = lightning.Trainer(strategy=SomatizeStrategy())   # or strategy="somatize"
    trainer.fit(model)   # model holds GraphModule(Graph.somatize(Body().at("worker") >> Head()))

Workers are ``somatize.remote``'s: embedded (started here on loopback) when none are
given, standing with ``workers={"worker": Worker.at("node3:7000")}``, and under
torchrun ranks >= 1 serve (``serve_if_worker``) and exit 0 when the coordinator is done.
A training step is ``somatize.torch``'s ``Step``, the one ``Trainer`` drives (so its
refusals are the Trainer's); Lightning computes the loss and steps the local optimizer,
and the trainers over there step with it.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from typing_extensions import override

from .. import _trace
from .._errors import Refused, WorkerError
from .._learning import Learning
from .._memory import params_of
from .._trace import span
from ..remote import serve_if_worker
from ..torch import GraphModule, Split
from ..torch._step import Step, refuse_unknown, settle
from ..torch._tracer import Tracer
from ._callback import graph_modules
from ._dropin import DropIn

log = logging.getLogger(__name__)


class _ServingLauncher(_Launcher):
    """Rank 0 trains; under torchrun, every other rank serves as a worker and exits 0."""

    def __init__(self, strategy: SomatizeStrategy):
        self.strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        serve_if_worker()  # ranks >= 1 serve here until rank 0 is done, then exit 0
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        self.strategy._broken = True
        self.strategy.close()


class SomatizeStrategy(SingleDeviceStrategy):
    """Run a LightningModule's graphs with their placement honoured; train placed nodes there.

    Args:
        trains: ``{node_id: Learning}`` (a ``Split``, or an optimizer factory such as
            ``functools.partial(SGD, lr=0.1)``) for the placed nodes to train where they run.
            With ``place=``, keyed by placed module paths: the optimizer that trains that
            module over there instead of mirrors of Lightning's.
            ``None``: every placed node with parameters gets a ``Split`` mirroring the local
            optimizer that holds them (same class and hyper-parameters).
        workers: ``{host: Worker}`` (``Worker.at("node3:7000")`` for a standing worker,
            ``Worker.embedded(store=...)`` for one that keeps what it runs); hosts not
            given get an embedded worker, or under torchrun the rank that serves them.
        store: unused here; give a store to ``SomatizeCache``.
        trace: a path: write a Chrome trace-event file of the run there (Perfetto,
            chrome://tracing): one lane per process, spans for each forward and backward,
            transfer (with its bytes), optimizer step and wait; written at teardown.
        place: ``{submodule path: worker}``: the drop-in route. The named submodules of
            an unmodified LightningModule (``"encoder"``, ``"model.transformer"``) run and
            train on those workers; nothing in the model changes.
    """

    strategy_name = "somatize"

    def __init__(self, trains: Mapping[str, Any] | None = None, workers: Any = None,
                 store: Any = None, place: Mapping[str, str] | None = None,
                 trace: str | os.PathLike | None = None, **kwargs: Any):
        super().__init__(device=torch.device("cpu"), **kwargs)  # Lightning's, at setup
        self.place = dict(place or {})
        self.dropin: DropIn | None = None
        self.trace = trace
        self._tracer: Tracer | None = None
        self._placed_ran: dict = {}
        self._lost: str | None = None  # a worker lost with trained state: nothing to save
        self.trains = dict(trains) if trains is not None else None
        self.workers = dict(workers) if workers else None
        self._warm_up([])
        self.store = store
        self.runs: dict[str, Step] = {}  # by the GraphModule's name in the LightningModule
        self._graph_modules: dict[str, GraphModule] = {}
        self._broken = False

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        self._warm_up(graph_modules(model))

    def _warm_up(self, graph_modules: list) -> None:
        # the embedded workers' processes start as soon as their hosts are known (when
        # the strategy is built, for place=) and import torch while the Trainer is built
        # and Lightning sets up: the first batch waits only for them to join
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return  # torchrun: ranks serve
        from ..remote import Worker
        from ..remote._group import group

        hosts = set(self.place.values())
        for gm in graph_modules:
            hosts |= set(gm.graph.placement.workers())
        given = self.workers or {}
        embedded = [h for h in hosts if not isinstance(given.get(h), str)
                    and (given.get(h) or Worker.embedded()).kind == "embedded"]
        if embedded:
            group().prespawn(len(embedded))

    @override
    def setup_environment(self) -> None:
        # the local half on Lightning's root device (accelerator="gpu" gives cuda:N)
        trainer = self.lightning_module.trainer if self.lightning_module else None
        devices = getattr(getattr(trainer, "_accelerator_connector", None), "_parallel_devices",
                          None)
        if devices:
            self._root_device = torch.device(devices[0])
        super().setup_environment()

    # -- launching --------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._launcher = _ServingLauncher(self)

    def close(self) -> None:
        """Close this strategy's sessions on its workers (the worker processes are shared
        and stop when nobody uses them, or at exit)."""
        runs, self.runs = self.runs, {}
        for name, run in runs.items():
            self._graph_modules[name].runner = None  # its own forward again
            run.close()

    # -- setup ------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # Lightning quietly drops a single-device strategy to one device: read what was asked
        asked = getattr(trainer._accelerator_connector, "_devices_flag", 1)
        wanted = (len(asked) if isinstance(asked, (list, tuple))
                  else int(asked) if str(asked).isdigit() else 1)
        if max(wanted, trainer.num_devices) > 1 or trainer.num_nodes > 1:
            raise Refused(
                f"SomatizeStrategy drives one device here (devices={asked}, "
                f"num_nodes={trainer.num_nodes} given): the placed modules' workers are its "
                "other processes. Use lightning.Trainer(devices=1) and place more modules on "
                "more workers, or run data parallel under another strategy")
        if self.trace is not None and self._tracer is None:
            self._tracer = Tracer(self.trace)
        super().setup(trainer)
        model = self.lightning_module
        if self._lost:
            log.warning("a worker was lost with what it trained (%s): this run starts from the "
                        "copy here; resume from the last checkpoint to continue the lost run",
                        self._lost)
            self._lost, self._broken = None, False
        if self.dropin is not None:
            self.dropin.close(pull=not self._broken)
            self.dropin = None
        if self.place and self.trains and trainer.training and (
                trainer.gradient_clip_val or getattr(self.precision_plugin, "scaler", None)):
            raise Refused(
                "SomatizeStrategy(place=..., trains=...) with gradient clipping or a loss "
                "scaler: the optimizer you chose over there sees neither the norm nor the "
                "scale. Drop trains= (mirrors of your optimizers clip and unscale as one piece "
                "would), or train without them")
        if self.place:
            self.dropin = DropIn(model, self.place, self.optimizers, self.workers,
                                 self._lightning_optimizers, self.precision_plugin,
                                 self.root_device, trains=self.trains or {},
                                 schedulers=[c.scheduler for c in self.lr_scheduler_configs])
            self.dropin.fitting(trainer.training)

        named = {name: m for name, m in model.named_modules() if isinstance(m, GraphModule)}
        trains = self._trains(model, trainer) if trainer.training and not self.place else {}
        if trains:
            self._graph_route_limits(trainer)
        old, self.runs = self.runs, {}
        self._graph_modules = named
        # the new sessions first: the worker processes of the old ones are reused
        for name, gm in named.items():
            if gm.graph.placement.hosts:
                mine = {n: t for n, t in trains.items() if n in gm.graph.catalog}
                self.runs[name] = run = Step(gm.graph, mine, workers=self.workers,
                                             store=gm.store, optimizers=self.optimizers,
                                             defer=False)
                gm.runner = _runner(run)
        for run in old.values():
            run.close()
        if not any(isinstance(c, _EpochEnd) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _EpochEnd())  # before the user's own
        if self._tracer is not None:
            for run in self.runs.values():
                self._tracer.add(run.runtime)
            if self.dropin is not None:
                self._tracer.add(self.dropin.step.runtime)
        hosts = sorted({h for run in self.runs.values()
                        for h in run.running.placement.workers()})
        if hosts:
            log.info("the graph's placed nodes run on workers %s", hosts)
        elif not self.place:
            log.warning(
                "SomatizeStrategy places nothing: every module of %s runs here, as under "
                "Lightning's own strategy. Name what runs on a worker with "
                "SomatizeStrategy(place={'encoder': 'worker'}), or .at('worker') on a node "
                "of a GraphModule", type(model).__name__)

    def _graph_route_limits(self, trainer: pl.Trainer) -> None:
        # the graph route's trainers (Split) hold their own optimizers: no autocast, scaler
        # or clipping reaches them. The drop-in route (place=) has all three
        if type(self.precision_plugin) is not Precision:
            raise Refused(
                f"precision={trainer.precision!r}: a GraphModule's nodes trained on workers "
                "(Split) run in full precision only (autocast and a loss scale do not reach "
                "their optimizers). Use lightning.Trainer(precision='32-true'), or place "
                "plain submodules with SomatizeStrategy(place=...), which honours precision")
        if trainer.gradient_clip_val:
            raise Refused(
                "gradient_clip_val with a GraphModule's nodes trained on workers (Split): the "
                "norm would be taken over the weights here only. Train without "
                "gradient_clip_val, or place plain submodules with SomatizeStrategy(place="
                "...), which clips over every parameter as one piece would")

    def where(self) -> dict[str, dict[str, dict[int, int]]]:
        """Which processes ran each node of each GraphModule, and how often:
        ``{graph_module_name: {node: {pid: times}}}`` (the worker's pid for placed nodes);
        placed submodules under ``""``: ``{"": {"encoder": {pid: times}}}``."""
        out = {name: run.where() for name, run in self.runs.items()}
        if self.dropin is not None:
            self._placed_ran = self.dropin.where()
        if self._placed_ran:
            out[""] = self._placed_ran
        return out

    def traffic(self) -> tuple[float, int, int]:
        """Seconds this process waited on workers, bytes sent, bytes received, so far."""
        runtimes = [run.runtime for run in self.runs.values() if run.runtime is not None]
        if self.dropin is not None:
            runtimes.append(self.dropin.step.runtime)
        return (sum(r.waited for r in runtimes), sum(r.sent for r in runtimes),
                sum(r.received for r in runtimes))

    def sync(self) -> None:
        """Bring the weights of placed submodules here up to date (during fit they are
        trained over there, and the copy here is stale until an epoch ends)."""
        self._refuse_lost()
        if self.dropin is not None and not self._broken:
            try:
                self.dropin.sync()
            except WorkerError as e:
                raise self._lose(e) from None

    def _trains(self, model: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Learning]:
        """What trains each placed node; those nodes' parameters are taken out of
        Lightning's optimizers."""
        out: dict[str, Learning] = {}
        for gm in graph_modules(model):
            g = gm.graph
            settle(g)  # before params are read: what is frozen is not trained
            for n in g.ids:
                host = g.placement.get(n)
                params = {id(p) for p in params_of(g.catalog[n]) if p.requires_grad}
                if self.trains is not None:
                    if n not in self.trains:
                        continue
                    if host is None:
                        raise Refused(f"trains names {n!r}, which runs here: SomatizeStrategy "
                                      f"trains placed nodes; give {n!r} .at('worker') or train "
                                      "it with Lightning's optimizer")
                    t = self.trains[n]
                    out[n] = copy.copy(t) if isinstance(t, Learning) else Split(t)
                    if n in g.memory.frozen:
                        continue  # refused by the step, with the Trainer's words
                elif host is not None and params and n not in g.memory.frozen:
                    opt = next((o for o in self.optimizers for grp in o.param_groups
                                for p in grp["params"] if id(p) in params), None)
                    if opt is None:
                        continue  # no optimizer here holds it: it is not trained
                    if self.lr_scheduler_configs:
                        raise Refused(f"node {n!r} would be trained on worker {host!r} by a "
                                      "mirror of the local optimizer, which cannot follow a "
                                      "learning-rate scheduler: pass trains= explicitly")
                    out[n] = Split(type(opt), **opt.defaults)
                else:
                    continue
                # one step per backward unless Lightning accumulates (or the user steps)
                out[n].accumulates = not (trainer.lightning_module.automatic_optimization
                                          and trainer.accumulate_grad_batches == 1)
                self._take_out(n, host, params)
        if self.trains is not None:
            refuse_unknown(self.trains, [n for gm in graph_modules(model) for n in gm.graph.ids])
        return out

    def _take_out(self, n: str, host: str, params: set[int]) -> None:
        taken = 0
        for opt in self.optimizers:
            for grp in opt.param_groups:
                keep = [p for p in grp["params"] if id(p) not in params]
                taken += len(grp["params"]) - len(keep)
                grp["params"] = keep
        if taken:
            log.info("node %r is trained on worker %r: its %d parameter tensors were taken out "
                     "of Lightning's optimizers", n, host, taken)

    # -- a training step ----------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        for run in self.runs.values():
            run.discard()  # a step whose loss got no backward leaves nothing behind
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        # Strategy.backward, with the backward past the cut before on_after_backward
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args,
                                       **kwargs)
        for run in self.runs.values():
            run.backward()
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
        for run in self.runs.values():
            run.step_trainers()
        if self.dropin is not None:
            self.dropin.stepped(optimizer)
        return out

    # -- weights and checkpoints --------------------------------------------------------
    def pull_weights(self) -> dict[str, Any]:
        """Copy the weights trained on the workers into this process's GraphModules;
        return the trainers' states by GraphModule name."""
        self._refuse_lost()
        if self._broken:
            return {}
        try:
            return {name: run.pull() for name, run in self.runs.items() if run.trains}
        except WorkerError as e:
            raise self._lose(e) from None

    def _lose(self, e: WorkerError) -> WorkerError:
        """Remember that trained state was lost with a worker; the error that says so."""
        self._broken, self._lost = True, str(e).splitlines()[0]
        return self._lost_error()

    def _refuse_lost(self) -> None:
        if self._lost:
            raise self._lost_error()

    def _lost_error(self) -> WorkerError:
        return WorkerError(
            f"no checkpoint is written: the weights and optimizer state trained over there "
            f"were lost with their worker ({self._lost}), and the copy here is stale. The "
            "last checkpoint written is the point to resume from: fit(ckpt_path=...)")

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.pull_weights()
        self.sync()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if self.dropin is not None and not self._broken:
            state = self.dropin.optimizer_state(optimizer, state)
        return state

    @override
    def on_validation_start(self) -> None:
        self.sync()  # what a callback reads during validation is what was trained
        super().on_validation_start()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        states = self.pull_weights()
        if states:
            checkpoint["somatize"] = {"trainers": states}
        if self.dropin is not None and self.dropin.chosen and not self._broken:
            checkpoint.setdefault("somatize", {})["chosen"] = self.dropin.chosen_states()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.dropin is not None:
            self.dropin.load_optimizer_states(list(checkpoint.get("optimizer_states", [])))
            self.dropin.load_chosen_states(checkpoint.get("somatize", {}).get("chosen", {}))
        for name, states in checkpoint.get("somatize", {}).get("trainers", {}).items():
            if name in self.runs:
                self.runs[name].load_state({n: {"trainer": st} for n, st in states.items()})

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt) and self.dropin is not None:
            self.dropin.interrupt()  # teardown then waits for no worker, and says what is lost
        if isinstance(exception, WorkerError):
            self._broken = True
            if self.dropin is not None or any(run.trains for run in self.runs.values()):
                # what was trained over there since the last checkpoint is gone with it
                self._lost = str(exception).splitlines()[0]

    @override
    def teardown(self) -> None:
        if not self._lost:
            self.pull_weights()
        if self._tracer is not None and not self._broken:
            if self.dropin is not None:
                self.dropin.settle()
            self._tracer.write()
        for name, run in self.runs.items():
            self._graph_modules[name].runner = None  # its own forward again
            run.discard()
        if self.dropin is not None:
            self._placed_ran = self.dropin.where()  # still readable after fit
            dropin, self.dropin = self.dropin, None
            dropin.close(pull=not self._broken)
        if self._broken:
            self.close()  # a dead worker: nothing over there to keep a session for
        from ..remote._group import group

        group().drop_warm()  # started for a run that did not need them (refused, say)
        super().teardown()


class _EpochEnd(pl.Callback):
    """As an epoch ends, before the user's callbacks: the placed modules' weights here
    brought up to date, and the epoch's traffic logged: ``somatize/wait_ms`` (this
    process waiting on workers), ``somatize/bytes_sent``, ``somatize/bytes_received``."""

    def __init__(self):
        self.seen = (0.0, 0, 0)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = trainer.strategy.traffic()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        strategy.sync()
        now = strategy.traffic()
        waited, sent, received = (a - b for a, b in zip(now, self.seen, strict=True))
        self.seen = now
        if strategy.runs or strategy.dropin is not None:
            pl_module.log_dict({"somatize/wait_ms": waited * 1000.0,
                                "somatize/bytes_sent": float(sent),
                                "somatize/bytes_received": float(received)},
                               on_step=False, on_epoch=True)


def _runner(step: Step) -> Callable[..., Any]:
    """GraphModule's forward under the strategy: the step's, placed stretches on workers."""
    graph = step.graph

    def run(x: Any, *, feeds: Mapping[str, Any] | None, training: bool) -> Any:
        inputs = dict(feeds) if feeds is not None else dict.fromkeys(graph.roots, x)
        return step.forward(inputs, training=training)

    return run


if "somatize" not in StrategyRegistry:
    StrategyRegistry.register("somatize", SomatizeStrategy,
                              description="honours a graph's placement: placed nodes run and "
                                          "train on workers (somatize)")
