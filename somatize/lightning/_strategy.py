"""``SomatizeStrategy``: a Lightning strategy that honours a graph's placement — the
placed nodes run, and train, on workers; the rest runs here as it always did.

    trainer = lightning.Trainer(strategy=SomatizeStrategy())   # or strategy="somatize"
    trainer.fit(model)   # model holds GraphModule(Graph.somatize(Body().at("worker") >> Head()))

Workers are started here on loopback when none are given; under torchrun, ranks >= 1
serve the graph's workers (in first-use order) and exit 0 when the coordinator is done.
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from torch.distributed import rpc
from typing_extensions import override

from .._engine import walk
from .._errors import Refused, WorkerError
from .._values import Opaque, bare
from ..torch import GraphModule
from ._callback import graph_modules
from ._part import Part

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"


def _options(init_method: str, timeout: float) -> rpc.TensorPipeRpcBackendOptions:
    # uv: the default shm transport spins a core per process even when idle
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout,
                                           _transports=["uv"])


def _serve(name: str, rank: int, world_size: int, init_method: str, timeout: float) -> None:
    """A worker process: join the run's RPC group and serve until the coordinator leaves."""
    rpc.init_rpc(name, rank=rank, world_size=world_size,
                 rpc_backend_options=_options(init_method, timeout))
    rpc.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosts(model: Any) -> list[str]:
    """The workers a model's graphs ask for, in first-use order."""
    return list(dict.fromkeys(h for gm in graph_modules(model) for h in
                              gm.graph.placement.workers()))


class _ServingLauncher(_Launcher):
    """Rank 0 trains; under torchrun, every other rank serves one worker and exits 0."""

    def __init__(self, strategy: SomatizeStrategy):
        self.strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        rank = int(os.environ.get("RANK", "0"))
        if rank > 0:
            hosts = _hosts(args[0]) if args else []
            if rank > len(hosts):
                raise Refused(f"torchrun rank {rank} has no worker to serve: the graph asks "
                              f"for {hosts}; run torchrun --nproc-per-node={1 + len(hosts)}")
            log.info("rank %d serves worker %r", rank, hosts[rank - 1])
            _serve(hosts[rank - 1], rank, int(os.environ["WORLD_SIZE"]), "env://",
                   self.strategy.timeout)
            raise SystemExit(0)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        self.strategy._broken = True
        self.strategy.close()


class SomatizeStrategy(SingleDeviceStrategy):
    """Run a LightningModule's graphs with their placement honoured; train placed nodes there.

    Args:
        trains: ``{node_id: optimizer factory}`` (a ``Split``, or ``functools.partial(SGD,
            lr=0.1)``) for the placed nodes to train where they run. ``None``: every placed
            node with parameters gets a mirror of the local optimizer that holds them (same
            class and hyper-parameters).
        workers: reserved for standing workers (``{name: "host:port"}``); ``None`` starts the
            workers here (or, under torchrun, ranks >= 1 are the workers).
        store: unused here; give a store to ``SomatizeCache``.
        timeout: seconds an RPC to a worker may take before the run fails naming it.
    """

    strategy_name = "somatize"

    def __init__(self, trains: Mapping[str, Any] | None = None, workers: Any = None,
                 store: Any = None, timeout: float = 60.0, **kwargs: Any):
        super().__init__(device=torch.device("cpu"), **kwargs)
        self.trains = dict(trains) if trains is not None else None
        self.workers = workers
        self.store = store
        self.timeout = timeout
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self.parts: dict[str, rpc.RRef] = {}
        self.trained: dict[str, str] = {}  # node -> host, the nodes trained over there
        self._records: list[tuple[int, str, tuple[str, ...], dict, dict]] = []
        self._sid = 0
        self._started = False
        self._broken = False

    # -- launching and RPC ----------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._launcher = _ServingLauncher(self)

    @property
    @override
    def is_global_zero(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0

    def _start(self, hosts: list[str]) -> None:
        if self._started:
            return
        if self.workers is not None:
            raise Refused("SomatizeStrategy(workers=...) is for standing workers, which need "
                          "somatize.remote; leave workers=None to start them here, or use "
                          "torchrun --nproc-per-node=N")
        world = 1 + len(hosts)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            if int(os.environ["WORLD_SIZE"]) != world:
                raise Refused(f"the graph's workers are {hosts}: run torchrun with "
                              f"--nproc-per-node={world} (WORLD_SIZE is "
                              f"{os.environ['WORLD_SIZE']})")
            init = "env://"
        else:
            init = f"tcp://127.0.0.1:{_free_port()}"
            ctx = multiprocessing.get_context("spawn")
            for rank, host in enumerate(hosts, start=1):
                p = ctx.Process(target=_serve, args=(host, rank, world, init, self.timeout),
                                name=f"somatize-worker-{host}", daemon=True)
                p.start()
                self.processes[host] = p
            log.info("started local workers %s", hosts)
        rpc.init_rpc(COORDINATOR, rank=0, world_size=world,
                     rpc_backend_options=_options(init, self.timeout))
        self._started = True
        atexit.register(self.close)

    def close(self) -> None:
        """Leave the RPC group and stop the workers started here (idempotent)."""
        if self._started:
            self.parts.clear()
            self._started = False
            try:
                rpc.shutdown(graceful=not self._broken, timeout=self.timeout)
            except Exception as e:  # a dead worker: we are leaving anyway
                log.warning("leaving the RPC group: %s", e)
        for p in self.processes.values():
            p.join(timeout=self.timeout if not self._broken else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.processes.clear()

    # -- setup ----------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if type(self.precision_plugin) is not Precision:
            raise Refused(
                f"SomatizeStrategy trains in full precision only: precision="
                f"{trainer.precision!r} is refused (autocast does not cross a process, and "
                "a scaled loss would reach the workers' optimizers unscaled). Use "
                "lightning.Trainer(precision='32-true')")
        super().setup(trainer)
        model = self.lightning_module
        hosts = _hosts(model)
        self._start(hosts)
        trainable = trainer.training
        if trainable and trainer.gradient_clip_val:
            raise Refused(
                "gradient_clip_val is refused under SomatizeStrategy: the norm would be taken "
                "over the weights here only, not those trained on the workers. Clip inside "
                "the nodes' optimizers, or train without gradient_clip_val")
        factories = self._factories(model) if trainable else {}
        self.parts = {}
        for host in hosts:
            for gm in graph_modules(model):
                if host in gm.graph.placement.workers():
                    mine = {n: f for n, f in factories.items() if n in gm.graph.catalog
                            and gm.graph.placement.get(n) == host}
                    self.parts[host] = rpc.remote(host, Part, args=(gm.graph, host, mine),
                                                  timeout=self.timeout)
            self._call(host, "placing the graph", lambda h=host: self.parts[h].rpc_sync(
                timeout=self.timeout).optimizer_states())
        for gm in graph_modules(model):
            gm.runner = functools.partial(self._run, gm)

    def _factories(self, model: pl.LightningModule) -> dict[str, Callable[..., Any]]:
        """The optimizer factory of each placed node trained on its worker; those nodes'
        parameters are taken out of Lightning's optimizers."""
        out: dict[str, Callable[..., Any]] = {}
        self.trained = {}
        for gm in graph_modules(model):
            g = gm.graph
            for n in g.ids:
                host = g.placement.get(n)
                if n not in gm.nodes:
                    continue
                params = {id(p) for p in gm.nodes[n].parameters() if p.requires_grad}
                if self.trains is not None:
                    if n not in self.trains:
                        continue
                    if host is None:
                        raise Refused(f"trains names {n!r}, which runs here: SomatizeStrategy "
                                      f"trains placed nodes; give {n!r} .at('worker') or train "
                                      "it with Lightning's optimizer")
                    # a Split carries its factory; a bare factory (functools.partial) is one
                    out[n] = getattr(self.trains[n], "factory", None) or self.trains[n]
                elif host is not None and params:
                    opt = next((o for o in self.optimizers for grp in o.param_groups
                                for p in grp["params"] if id(p) in params), None)
                    if opt is None:
                        continue  # no optimizer here holds it: it is not trained
                    if self.lr_scheduler_configs:
                        raise Refused(f"node {n!r} would be trained on worker {host!r} by a "
                                      "mirror of the local optimizer, which cannot follow a "
                                      "learning-rate scheduler: pass trains= explicitly")
                    out[n] = functools.partial(type(opt), **opt.defaults)
                else:
                    continue
                self.trained[n] = host
                self._take_out(n, host, params)
        if self.trains is not None:
            known = {n for gm in graph_modules(model) for n in gm.graph.ids}
            missing = sorted(set(self.trains) - known)
            if missing:
                raise Refused(f"trains names {missing}, not in the graph; its nodes are "
                              f"{sorted(known)}")
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

    # -- the forward across processes ---------------------------------------------
    def _call(self, host: str, doing: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except WorkerError:
            raise
        except Exception as e:
            self._broken = True
            raise WorkerError(
                f"worker {host!r} failed while {doing}: {type(e).__name__}: {e}. It died, "
                f"timed out (after {self.timeout}s) or raised; see its log, then resume with "
                "trainer.fit(model, ckpt_path='last')") from e

    def _run(self, gm: GraphModule, x: Any, *, feeds: Mapping[str, Any] | None,
             training: bool) -> Any:
        """GraphModule's forward under this strategy: placed stretches run on their workers."""
        g = gm.graph
        grad = training and torch.is_grad_enabled()
        inputs = dict(feeds) if feeds is not None else {r: x for r in g.roots}
        out = walk(g, g.plan.order, inputs=inputs, keeper=gm.store,
                   naming=gm.store is not None, training=training,
                   remote=_Far(self, grad), wanted=g.sinks)
        result = {s: bare(out.values[s]) for s in g.sinks}
        return result[g.sinks[0]] if len(g.sinks) == 1 else result

    # -- the backward across processes --------------------------------------------
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        records, self._records = self._records, []
        # stages in reverse: each stretch's answer feeds the local graph that produced its input
        for sid, host, nodes, given, outs in reversed(records):
            grads = {n: t.grad for n, t in outs.items() if t.grad is not None}
            if not grads:
                continue
            back = self._call(host, f"the backward of {list(nodes)}",
                              lambda h=host, s=sid, gr=grads: self.parts[h].rpc_sync(
                                  timeout=self.timeout).backward(s, gr))
            pairs = [(given[p], back[p]) for p in back
                     if isinstance(given.get(p), torch.Tensor) and given[p].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [gr for _, gr in pairs])
        return loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        for host in self.parts:
            self._call(host, "stepping its optimizers",
                       lambda h=host: self.parts[h].rpc_sync(timeout=self.timeout).step())
        return out

    # -- weights and checkpoints ----------------------------------------------------
    def pull_weights(self) -> None:
        """Copy the weights trained on the workers into this process's GraphModule."""
        model = self.lightning_module
        if model is None or not self.parts or self._broken:
            return
        for host, part in self.parts.items():
            got = self._call(host, "sending its weights",
                             lambda p=part: p.rpc_sync(timeout=self.timeout).weights())
            for gm in graph_modules(model):
                for n, state in got.items():
                    if n in gm.nodes and gm.graph.placement.get(n) == host:
                        gm.nodes[n].load_state_dict(state)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.pull_weights()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        if self.parts and not self._broken:
            checkpoint["somatize"] = {"optimizers": {
                host: self._call(host, "sending its optimizer state",
                                 lambda p=part: p.rpc_sync(timeout=self.timeout)
                                 .optimizer_states())
                for host, part in self.parts.items()}}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        states = checkpoint.get("somatize", {}).get("optimizers", {})
        for host, state in states.items():
            if host in self.parts:
                self._call(host, "loading its optimizer state",
                           lambda h=host, s=state: self.parts[h].rpc_sync(
                               timeout=self.timeout).load_optimizer_states(s))

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, WorkerError):
            self._broken = True

    @override
    def teardown(self) -> None:
        self.pull_weights()
        for gm in graph_modules(self.lightning_module) if self.lightning_module else []:
            gm.runner = None
        self.parts = {}
        self._records = []
        if self._broken:
            self.close()  # a dead worker: do not wait for it at exit
        super().teardown()


class _Far:
    """The transport the engine hands remote stretches to, recording them for the backward."""

    def __init__(self, strategy: SomatizeStrategy, grad: bool):
        self.strategy = strategy
        self.grad = grad

    def keeps(self) -> bool:
        return False

    def submit(self, stretch: Any) -> _Answer:
        s = self.strategy
        s._sid += 1
        sid = s._sid
        given = {p: bare(v) for p, v in stretch.given.items()}
        sent = {p: Opaque(t.detach()) if isinstance(t, torch.Tensor) else t
                for p, t in given.items()}
        part = s.parts.get(stretch.host)
        if part is None:
            raise Refused(f"nodes {list(stretch.nodes)} are placed on {stretch.host!r}, which "
                          "this strategy did not set up")
        fut = part.rpc_async(timeout=s.timeout).run(
            sid, stretch.nodes, sent, dict(stretch.inputs), stretch.wanted, stretch.training,
            self.grad)
        return _Answer(s, sid, stretch, given, fut, self.grad)


class _Answer:
    """A remote stretch in flight; ``result()`` gives its values as local leaves."""

    def __init__(self, strategy, sid, stretch, given, fut, grad):
        self.strategy, self.sid, self.stretch = strategy, sid, stretch
        self.given, self.fut, self.grad = given, fut, grad

    def result(self) -> Any:
        from .._engine import Outcome

        s, st = self.strategy, self.stretch
        got = s._call(st.host, f"running {list(st.nodes)}", self.fut.wait)
        values, outs = {}, {}
        for n, v in got.items():
            t = bare(v)
            if isinstance(t, torch.Tensor):
                t = t.to(s.root_device)
                if self.grad and t.is_floating_point():
                    t = t.requires_grad_()  # a leaf: the backward stops here and goes over
                    outs[n] = t
                v = Opaque(t)
            values[n] = v
        if self.grad:
            s._records.append((self.sid, st.host, st.nodes, self.given, outs))
        return Outcome(values=values, ran=list(st.nodes))


if "somatize" not in StrategyRegistry:
    StrategyRegistry.register("somatize", SomatizeStrategy,
                              description="honours a graph's placement: placed nodes run and "
                                          "train on workers (somatize)")
