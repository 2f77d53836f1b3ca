"""Train the example (``examples/digits.py``, a plain LightningModule: an encoder, ``body``,
and a classifier ``head`` on scikit-learn's digits) with Lightning, configured by Hydra
(configs/train.yaml). This file sits at the repository root, so the root is on
``sys.path`` and ``examples.digits`` imports here, in torchrun's ranks (the same script)
and in the workers somatize starts (they get this process's ``sys.path``).

    python train.py                                  # in one piece, here
    python train.py trainer.max_epochs=3 model.lr=0.2
    python train.py +somatize=split                  # the body on a local worker process
    python train.py +somatize=split '~somatize.place' '+somatize.place={head: worker}'
    python train.py +somatize=cached model.body_from=outputs/.../checkpoints/last.ckpt

Give the coordinator ``OMP_WAIT_POLICY=PASSIVE`` when a worker shares its cores (as
``scripts/run.sh`` does; torch reads it once, at import, so only the launch can set it):
libgomp's threads otherwise spin for milliseconds after every op, on the cores the worker
computes on (2-5x slower steps on 2 cores, docs/performance.md). Workers started by
somatize get it by default.

    OMP_WAIT_POLICY=PASSIVE python train.py +somatize=split

Under torchrun, rank 0 is the coordinator and ranks >= 1 serve as workers:

    torchrun --standalone --nproc-per-node=2 train.py +somatize=split

On two machines (the coordinator pinned to rank 0; the worker's name comes from
somatize.place):

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
from collections import Counter

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from somatize import SomatizeError

    try:
        return run(cfg)
    except SomatizeError as e:  # what the command line got wrong: one line, no traceback
        log.error("%s", e)
        raise SystemExit(1) from None


def run(cfg: DictConfig) -> float | None:
    """Fit, then test, on one start of each worker (they serve both)."""
    from somatize.remote import keep_workers

    pl.seed_everything(cfg.seed, workers=True)
    across_machines(cfg.get("somatize", {}))
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values() if c]
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    here = count_calls_here(trainer, model)
    with keep_workers():
        trainer.fit(model, data, ckpt_path=cfg.ckpt_path)
        if not trainer.is_global_zero:
            return None
        for module, said in where(trainer, model, here).items():
            log.info("module %r %s", module, said)
        if not cfg.test:
            return None
        acc = trainer.test(model, data, verbose=False)[0]["test_acc"]
    log.info("accuracy on held-out digits: %.3f", acc)
    return acc


def across_machines(knobs) -> None:
    """``somatize.listen``: the address this coordinator binds, which workers on other
    machines reach; ``somatize.token_file``: a copy of the standing worker's token."""
    from somatize.remote import configure
    from somatize.remote._secret import TOKEN_FILE_ENV, read_token_file

    if knobs.get("listen"):
        configure(listen=str(knobs.listen))
    if knobs.get("token_file"):
        path = os.path.abspath(str(knobs.token_file))
        read_token_file(path)  # refused here, in one line, when missing, a link or unsafe
        os.environ[TOKEN_FILE_ENV] = path


def count_calls_here(trainer: pl.Trainer, model: pl.LightningModule) -> Counter:
    """Count the calls of the model's modules that run in this process (the strategy
    counts those it places, in the process that ran them)."""
    placed = getattr(trainer.strategy, "place", None) or {}
    calls: Counter = Counter()
    for name, module in model.named_children():
        if name not in placed:
            module.register_forward_pre_hook(lambda *_, n=name: calls.update([n]))
    return calls


def where(trainer: pl.Trainer, model: pl.LightningModule, here: Counter) -> dict[str, str]:
    """Where each module of the model that ran here ran, by this process's pid (the
    strategy says where the placed ones ran, and SomatizeCache what it read back)."""
    from somatize.lightning import SomatizeCache

    ran = trainer.strategy.where() if hasattr(trainer.strategy, "where") else {}
    cache = next((c for c in trainer.callbacks if isinstance(c, SomatizeCache)), None)
    said = {}
    for name, _ in model.named_children():
        if name in ran or not here[name]:
            continue  # placed (said by the strategy), or never called
        cached = cache is not None and name in cache.modules
        said[name] = (f"{'was called' if cached else 'ran'} in process {os.getpid()} (here) "
                      f"{here[name]} times")
    return said


if __name__ == "__main__":
    # under torchrun only rank 0 writes Hydra's output directory; the others serve
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null",
                     "hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
