"""Train the example (an encoder and a classifier head on scikit-learn's digits) with
Lightning, configured by Hydra (configs/train.yaml).

    python train.py                                  # in one piece, here
    python train.py trainer.max_epochs=3 model.lr=0.2
    python train.py +somatize=split                  # the body on a local worker process
    python train.py +somatize=split somatize.trains.body.lr=0.05
    python train.py +somatize=cached model.body_from=outputs/.../checkpoints/last.ckpt

Give the coordinator ``OMP_WAIT_POLICY=PASSIVE`` when a worker shares its cores (as
``scripts/run.sh`` does; torch reads it once, at import, so only the launch can set it):
libgomp's threads otherwise spin for milliseconds after every op, on the cores the worker
computes on (2-5x slower steps on 2 cores, docs/performance.md). Workers started by
somatize get it by default.

    OMP_WAIT_POLICY=PASSIVE python train.py +somatize=split

Under torchrun, rank 0 is the coordinator and ranks >= 1 serve as workers:

    torchrun --standalone --nproc-per-node=2 train.py +somatize=split

On two machines (the coordinator pinned to rank 0; the worker's name comes from the model):

    # on node A (the coordinator, reachable at 10.0.0.1)
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=10.0.0.1 \
        --master-port=29500 train.py +somatize=split
    # on node B (the worker)
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --master-addr=10.0.0.1 \
        --master-port=29500 train.py +somatize=split
"""

import logging
import os
import sys

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    pl.seed_everything(cfg.seed, workers=True)
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values() if c]
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    trainer.fit(model, data, ckpt_path=cfg.ckpt_path)
    if not trainer.is_global_zero:
        return None
    for node, said in where(trainer, model).items():
        log.info("node %r %s", node, said)
    if cfg.test:
        acc = trainer.test(model, data, verbose=False)[0]["test_acc"]
        log.info("accuracy on held-out digits: %.3f", acc)
        return acc
    return None


def where(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, str]:
    """Where each node of the model's graph ran, by the processes that ran it (the
    strategy counts them: placement is honoured by one strategy), and for a cached node
    how many batches it ran for and how many its output was read from the store for."""
    from somatize.lightning import SomatizeCache, SomatizeStrategy

    graph = model.net.graph
    strategy = trainer.strategy
    ran = strategy.where().get("net", {}) if isinstance(strategy, SomatizeStrategy) else {}
    cache = next((c for c in trainer.callbacks if isinstance(c, SomatizeCache)), None)
    here = os.getpid()
    said = {}
    for n in graph.ids:
        pids = ran.get(n) or {here: None}  # not counted: GraphModule ran it in this process
        said[n] = "ran in " + ", ".join(
            f"process {pid} ({'here' if pid == here else f'worker {graph.placement.get(n)!r}'})"
            + (f" {times} times" if times else "") for pid, times in pids.items())
        if cache is not None and n in graph.memory.cached:  # the example caches one node
            said[n] += (f"; it ran for {cache.misses} batches, its output was read from the "
                        f"store for {cache.hits}")
    return said


if __name__ == "__main__":
    # under torchrun only rank 0 writes Hydra's output directory; the others serve
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null",
                     "hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
