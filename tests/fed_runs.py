"""One data owner's process for the study tests: for each study named, an ordinary
Lightning fit of ``fed_models.Net`` whose trunk is the study's shared module; what it
ends with (own parts, losses) written to OUT/<study>-<owner>.pt.

    python tests/fed_runs.py --hub 127.0.0.1:PORT --pki DIR --owner a --studies DIR \\
        --out DIR v1 arr rr [--kill dropv1:1:0] [--delays arr] [--epochs res:2] \
        [--then res:ADDRESS_FILE] [--slow slowv1:1:0:barrier] [--slow slowv2:1:0:backward]

``--slow STUDY:EPOCH:BATCH:HOW``: this owner is slow but alive at that step; ``barrier``:
after the step, it waits until the hub has written the round's barrier without it (in
DIR/ck, the hub's --checkpoints); ``backward``: its Forward sent, it sleeps past the
study's turn_timeout before its Backward. The fit's ``Excluded`` is written as its result.
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from somatize.fed import Excluded, Study, StudyConfig  # noqa: E402
from somatize.lightning import SomatizeStrategy  # noqa: E402
from tests.fed_models import make_net, owner_loader, owner_seed  # noqa: E402


class Record(pl.Callback):
    def __init__(self, study, kill, delay, slow=None, barrier=None, late=0.0):
        self.losses, self.study, self.kill, self.delay = [], study, kill, delay
        self.rng = random.Random(os.getpid())
        self.slow, self.barrier, self.late = slow, barrier, late

    def _at(self, trainer, how):
        return self.slow is not None and self.slow == (
            trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx, how)

    def on_train_batch_start(self, trainer, module, batch, i):
        if self.delay:
            time.sleep(self.rng.random() * 0.03)

    def on_before_backward(self, trainer, module, loss):
        if self.kill == (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx):
            os._exit(3)  # lost mid-step: its Forward ran on the hub, no Backward comes
        if self._at(trainer, "backward"):  # slow mid-step: its Backward comes late
            time.sleep(self.late)

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        self.losses.append(float(outputs["loss"]))
        if self._at(trainer, "barrier"):  # late at the barrier: the others closed it
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (
                    self.barrier.exists() and int(self.barrier.read_text()) > self.slow[0]):
                time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hub")
    ap.add_argument("--averager", help="the address of the averager of studies naming one")
    ap.add_argument("--pki")
    ap.add_argument("--owner")
    ap.add_argument("--name")
    ap.add_argument("--configs")
    ap.add_argument("--out")
    ap.add_argument("--kill", action="append", default=[])
    ap.add_argument("--delays", action="append", default=[])
    ap.add_argument("--epochs", action="append", default=[])
    ap.add_argument("--slow", action="append", default=[])
    ap.add_argument("--then", help="STUDY:FILE: once FILE holds a hub's address, resume "
                                   "STUDY's fit from its last checkpoint there")
    ap.add_argument("studies", nargs="+")
    a = ap.parse_args()
    kills = {k.split(":")[0]: (int(k.split(":")[1]), int(k.split(":")[2])) for k in a.kill}
    epochs = {k.split(":")[0]: int(k.split(":")[1]) for k in a.epochs}
    a.slow = {k.split(":")[0]: (int(k.split(":")[1]), int(k.split(":")[2]), k.split(":")[3])
              for k in a.slow}
    name = a.name or a.owner
    for s in a.studies:
        fit(a, s, a.hub, name, kills, epochs, resume=False)
    if a.then:
        s, file = a.then.split(":", 1)
        deadline = time.monotonic() + 300
        while not os.path.exists(file) and time.monotonic() < deadline:
            time.sleep(0.1)
        fit(a, s, Path(file).read_text(), name, kills, {}, resume=True)
    return 0


def fit(a, s, hub, name, kills, epochs, resume):
    """One study's fit, its results written to OUT/<study>-<name>.pt."""
    cfg = StudyConfig.load(Path(a.configs) / f"{s}.toml")
    study = Study(cfg, hub=hub, owner=a.owner, identity=Path(a.pki) / f"{a.owner}.pem",
                  ca=Path(a.pki) / "ca.pem", timeout=20,
                  averager=a.averager if cfg.averager else None)
    torch.manual_seed(owner_seed(a.owner))
    model = make_net(cfg)
    rec = Record(s, kills.get(s), s in a.delays, a.slow.get(s),
                 Path(a.configs) / "ck" / s / "latest", cfg.turn_timeout + 1.0)
    out = Path(a.out)
    keep = s == (a.then or ":").split(":")[0]  # only what resumes writes checkpoints
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=out / f"ckpt-{s}-{name}", save_last=True,
                                        save_top_k=0)
    length = {"max_epochs": epochs.get(s, cfg.rounds or 2)}
    if cfg.round_steps:  # rounds of N steps: a checkpoint at each round's end
        length = {"max_epochs": -1, "max_steps": cfg.rounds * cfg.round_steps}
        keep, ckpt = True, pl.callbacks.ModelCheckpoint(
            dirpath=out / f"ckpt-{s}-{name}", every_n_train_steps=cfg.round_steps,
            save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(**length,
                         strategy=SomatizeStrategy(place={"trunk": study.shared}),
                         logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[rec, ckpt] if keep else [rec],
                         enable_checkpointing=keep)
    last = str(out / f"ckpt-{s}-{name}" / "last.ckpt") if resume else None
    result = {}
    try:
        trainer.fit(model, owner_loader(a.owner), ckpt_path=last)
    except Excluded as e:
        if s not in a.slow:
            raise
        result = {"error": type(e).__name__, "message": str(e), "round": e.round,
                  "rejoin": e.rejoin}
    own = {k: v for k, v in model.state_dict().items() if not k.startswith("trunk.")}
    torch.save({"state": own, "losses": rec.losses, **result},
               out / f"{s}-{name}.pt.tmp")
    os.replace(out / f"{s}-{name}.pt.tmp", out / f"{s}-{name}.pt")


if __name__ == "__main__":
    sys.exit(main())
