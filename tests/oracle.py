"""The tests' one oracle kit: what a run is compared by, written once.

    losses = Losses()                       # every training step's loss, as a float
    trainer, losses = fit(model, strategy, data, max_epochs=2)
    w = weights(model)                      # a module's state (copies), or a Graph's by node
    assert same(run_a, run_b)               # bit for bit: keys, ==, torch.equal, nested
    exact(plain, split)                     # the same, saying which part differs first

A fit here is quiet (no logger, bar, summary or checkpoints unless asked) and is given
the callbacks and Trainer arguments of the case; a case seeds its own runs."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class Losses(pl.Callback):
    """Every training step's loss, as a float (manual optimization that returns nothing:
    the ``loss`` it logged)."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        got = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.callback_metrics.get("loss", got)) if got is None
                           else got.item())


def fit(model: pl.LightningModule, strategy: Any = "auto", data: Any = None, *,
        ckpt_path: str | None = None, callbacks=(), **trainer_args) -> tuple[pl.Trainer, list]:
    """``model`` fitted on ``data`` under ``strategy``: the Trainer and the losses."""
    losses = Losses()
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False,
             "enable_checkpointing": False}
    trainer = pl.Trainer(strategy=strategy, callbacks=[losses, *callbacks],
                         **{**quiet, **trainer_args})
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, losses.losses


def weights(of: Any) -> dict:
    """Copies of what ``of`` holds: a module's state_dict by name, or a Graph's
    parameters by node id (a list per node)."""
    if isinstance(of, torch.nn.Module):
        return {k: v.detach().clone() for k, v in of.state_dict().items()}
    return {n: [p.detach().clone() for p in node.parameters()]
            for n, node in of.catalog.items() if hasattr(node, "parameters")}


def same(a: Any, b: Any) -> bool:
    """Bit for bit: the same keys and lengths, ``==`` values and ``torch.equal`` tensors,
    nested through dicts, lists and tuples."""
    return _first_difference(a, b, "") is None


def exact(a: Any, b: Any) -> None:
    """Assert ``same(a, b)``, naming the first place they differ (``[1]['encoder.w']``)."""
    where = _first_difference(a, b, "")
    assert where is None, f"not bit for bit at {where or 'the top'}"


def _first_difference(a: Any, b: Any, at: str) -> str | None:
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{at} (keys)"
        return next((d for k in a if (d := _first_difference(a[k], b[k], f"{at}[{k!r}]"))
                     is not None), None)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{at} (length)"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (d := _first_difference(x, y, f"{at}[{i}]")) is not None), None)
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and torch.equal(a, b)
        return None if ok else at
    return None if a == b else at


def many(cases: dict, out: str, names: tuple) -> None:
    """A scenario script's ``many OUT CASE...``: several cases in one process (one
    interpreter start, one worker), each ``cases[name](<OUT's folder>/<name>.pt)``; the
    list of names is written to ``out``."""
    import os

    for name in names:
        cases[name](os.path.join(os.path.dirname(out), f"{name}.pt"))
    torch.save(list(names), out)


def placed_exact(got: dict, placed: str, steps: int) -> None:
    """A scenario's ``plain`` and ``split`` runs of a placed module, bit for bit: the
    losses ``==`` for at least ``steps`` steps, every weight ``torch.equal``, and the
    module ``placed`` run at least ``steps`` times, none of them in this test's ``pid``."""
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert len(plain_losses) >= steps and split_losses == plain_losses
    assert plain.keys() == split.keys()
    for k in plain:
        assert torch.equal(split[k], plain[k]), k
    assert got["pid"] not in got["ran"][placed] and sum(got["ran"][placed].values()) >= steps
