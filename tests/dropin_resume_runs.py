"""Drop-in runs that checkpoint and resume: plain from plain, split from plain, plain from
split, and a finetuning run resumed after its backbone joined the optimizer. Run through
tests/dropin_runs.py, or alone:

    python tests/dropin_resume_runs.py resumes OUT.pt
"""

import os
import sys

import lightning.pytorch as pl
import torch
from dropin_models import AutoEncoder, Finetuned, digits, fit
from oracle import Losses

from somatize.lightning import SomatizeStrategy


def finetune_resumed(out):
    """Finetuned to epoch 2 (the backbone unfrozen at 1, its group added) and checkpointed
    plainly, then resumed to epoch 3 plainly and placed: the restored group's Adam state
    must reach the mirror."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    ckpt_dir = os.path.join(os.path.dirname(out), "finetune-ckpt")
    pl.seed_everything(0)
    fit(Finetuned(), "auto", digits(), max_epochs=2, enable_checkpointing=True,
        default_root_dir=ckpt_dir, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    ckpt = next(os.path.join(r, f) for r, _, fs in os.walk(ckpt_dir) for f in fs
                if f.endswith(".ckpt"))
    got = {}
    for name, strategy in (("plain", lambda: "auto"),
                           ("split", lambda: SomatizeStrategy(place={"backbone": "worker"}))):
        pl.seed_everything(1)
        model, losses = Finetuned(), Losses()
        trainer = pl.Trainer(logger=False, enable_progress_bar=False,
                             enable_model_summary=False, strategy=strategy(),
                             callbacks=[losses, BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
                             max_epochs=3, enable_checkpointing=False)
        trainer.fit(model, digits(), ckpt_path=ckpt)
        got[name] = (losses.losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    torch.save({**got, "vals": (None, None), "ran": {}, "pid": os.getpid()}, out)


def resume(out, first, then):
    """Epoch 1 under ``first`` (checkpointed), then resumed under ``then`` to epoch 2."""
    ckpt_dir = os.path.join(os.path.dirname(out), f"{first}-{then}")
    strategies = {"plain": lambda: "auto",
                  "split": lambda: SomatizeStrategy(place={"encoder": "worker"})}
    pl.seed_everything(0)
    fit(AutoEncoder(), strategies[first](), digits(), max_epochs=1, limit_val_batches=1,
        accumulate_grad_batches=2, enable_checkpointing=True, default_root_dir=ckpt_dir)
    ckpt = next(os.path.join(r, f) for r, _, fs in os.walk(ckpt_dir) for f in fs
                if f.endswith(".ckpt"))
    saved = torch.load(ckpt, weights_only=False)
    pl.seed_everything(1)
    model = AutoEncoder()
    losses = Losses()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=strategies[then](), callbacks=[losses], max_epochs=2,
                         limit_val_batches=1, accumulate_grad_batches=2,
                         enable_checkpointing=False)
    trainer.fit(model, digits(), ckpt_path=ckpt)
    torch.save({"losses": losses.losses, "ckpt": {"state_dict": saved["state_dict"],
                                                   "optimizer_states": saved["optimizer_states"],
                                                   "lr_schedulers": saved["lr_schedulers"]},
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               out)


def resumes(out):
    """The three resumes the test compares, in one process: plain from plain (the
    oracle: Lightning does not checkpoint the RNG), split from plain, plain from split."""
    got = {}
    for first, then in (("plain", "plain"), ("plain", "split"), ("split", "plain")):
        path = os.path.join(os.path.dirname(out), f"{first}-{then}.pt")
        resume(path, first, then)
        got[f"{first}-{then}"] = torch.load(path, weights_only=False)
    torch.save(got, out)


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
