"""The strategy's own callbacks cost nothing on the per-batch hooks they do not define:
Lightning calls every callback's every hook in a profiler context, and skips one that
is not callable (`somatize/lightning/_quiet.py`)."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import PassThroughProfiler

from somatize.lightning import SomatizeCache, SomatizeStrategy
from somatize.lightning._quiet import PER_BATCH, Quiet


class Recording(PassThroughProfiler):
    """Lightning's own do-nothing profiler, keeping the name of every hook it wrapped."""

    def __init__(self):
        super().__init__()
        self.actions = []

    def start(self, action_name: str) -> None:
        self.actions.append(action_name)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Counts(Quiet):
    """Defines two hooks of its own: those run, the other per-batch ones are skipped."""

    def __init__(self):
        self.batches = self.epochs = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs += 1


def fit(callbacks, strategy="auto"):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g),
                                          torch.randn(24, 1, generator=g))
    profiler = Recording()
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         profiler=profiler, strategy=strategy, callbacks=callbacks)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
    return trainer, profiler.actions


def test_a_quiet_callback_runs_its_own_hooks_and_no_other_per_batch_hook():
    counts = Counts()
    _, actions = fit([counts])
    assert (counts.batches, counts.epochs) == (6, 2)  # 3 batches an epoch, 2 epochs
    mine = [a for a in actions if a.startswith("[Callback]Counts.")]
    assert mine.count("[Callback]Counts.on_train_batch_end") == 6
    assert mine.count("[Callback]Counts.on_train_epoch_end") == 2
    assert not [a for a in mine if a.rsplit(".", 1)[1] in PER_BATCH
                and a != "[Callback]Counts.on_train_batch_end"], mine
    # a plain callback still has every hook called (Lightning's behaviour, unchanged)
    plain = pl.Callback()
    _, actions = fit([plain])
    assert actions.count("[Callback]Callback.on_before_backward") == 6


def test_the_strategys_epoch_callback_and_the_cache_callback_skip_per_batch_hooks(tmp_path):
    trainer, actions = fit([SomatizeCache(tmp_path / "store")], strategy=SomatizeStrategy())
    names = {type(c).__name__ for c in trainer.callbacks}
    assert {"_EpochEnd", "SomatizeCache"} <= names
    for who in ("_EpochEnd", "SomatizeCache"):
        called = {a.rsplit(".", 1)[1] for a in actions if a.startswith(f"[Callback]{who}.")}
        assert called, who
        assert not called & set(PER_BATCH) - set(_defined(who, trainer)), (who, called)
    assert "[Callback]_EpochEnd.on_train_epoch_end" in actions


def _defined(who, trainer):
    cls = type(next(c for c in trainer.callbacks if type(c).__name__ == who))
    return [n for n in PER_BATCH if getattr(cls, n) is not getattr(pl.Callback, n)]
