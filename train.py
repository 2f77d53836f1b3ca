"""Train the example (an encoder and a classifier head on scikit-learn's digits) with
Lightning, configured by Hydra (configs/train.yaml).

    python train.py                                  # in one piece, here
    python train.py trainer.max_epochs=3 model.lr=0.2
    python train.py +somatize=split                  # the body on a local worker process
    python train.py +somatize=split somatize.trains.body.lr=0.05
    python train.py +somatize=cached model.body_from=outputs/.../checkpoints/last.ckpt

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
    for node, host in where(trainer, model).items():
        log.info("node %r ran %s", node, f"on worker {host!r}" if host else "here")
    if cfg.test:
        acc = trainer.test(model, data, verbose=False)[0]["test_acc"]
        log.info("accuracy on held-out digits: %.3f", acc)
        return acc
    return None


def where(trainer: pl.Trainer, model: pl.LightningModule) -> dict:
    """Where each node of the model's graph ran: placement is honoured by one strategy."""
    from somatize.lightning import SomatizeStrategy

    graph = model.net.graph
    honoured = isinstance(trainer.strategy, SomatizeStrategy)
    return {n: graph.placement.get(n) if honoured else None for n in graph.ids}


if __name__ == "__main__":
    # under torchrun only rank 0 writes Hydra's output directory; the others serve
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null",
                     "hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
