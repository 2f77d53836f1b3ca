"""Callbacks that Lightning does not call on the hooks they leave alone: Lightning calls
every callback's every per-batch hook, each inside a profiler context (about a dozen
Python calls each, six hooks a training step); one this class leaves unset is ``None``
on the instance, which Lightning's ``callable(hook)`` check skips.

    class _EpochEnd(Quiet): ...     # only its epoch hooks are ever called
"""

from __future__ import annotations

import lightning.pytorch as pl

# the hooks Lightning calls through `_call_callback_hooks` (which skips what is not
# callable) once or more a batch; the rest it calls directly, or rarely
PER_BATCH = ("on_train_batch_start", "on_train_batch_end", "on_before_backward",
             "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
             "on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start",
             "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end")


class Quiet(pl.Callback):
    """A callback whose per-batch hooks its class does not define are never called."""

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        for name in PER_BATCH:
            if getattr(cls, name) is getattr(pl.Callback, name):
                setattr(self, name, None)
        return self
