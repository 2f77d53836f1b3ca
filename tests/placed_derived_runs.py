"""A placed module whose worker is of another organization (``Worker(rng="derived")``):
no RNG state crosses, and the fit equals its one-piece oracle (``DerivedRNG``) bit for
bit. Every message of the placed fits is audited as it is pickled or unpickled here (the
tensors beside each message, and each Call's and Answer's ``rng``). A case of
placed_runs.py's ``many`` (tests/test_placed_ordinary.py reads what it saves)."""

import dataclasses

import lightning.pytorch as pl
import torch
import torch.utils.data as tud
from dropin_models import fit
from torch import nn
from torch.nn import functional as F

from somatize.lightning import DerivedRNG, SomatizeStrategy
from somatize.remote import Worker


class Noisy(pl.LightningModule):
    """Dropout in the placed encoder, shuffled batches (the RNG here), a validation."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5),
                                     nn.Linear(32, 8))
        self.head = nn.Linear(8, 64)
        self.vals = []

    def training_step(self, batch, i):
        x = batch[0]
        loss = F.mse_loss(self.head(self.encoder(x)), x)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, i):
        x = batch[0]
        self.vals.append(F.mse_loss(self.head(self.encoder(x)), x).item())

    def val_dataloader(self):
        return tud.DataLoader(tud.TensorDataset(_rows(32)), batch_size=16)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _rows(n):
    from sklearn.datasets import load_digits

    return torch.tensor(load_digits().data[:n], dtype=torch.float32) / 16.0


def _data():
    return tud.DataLoader(tud.TensorDataset(_rows(64)), batch_size=16, shuffle=True)


class Audit(pl.Callback):
    """Every message this process sends to or receives from a worker during training,
    seen where RPC pickles and unpickles it: the tensors that travel beside it, and the
    placed Calls and Answers it holds."""

    def __init__(self):
        self.tensors, self.calls, self.answers = [], [], []
        self.undo = None

    def on_train_start(self, trainer, pl_module):
        from somatize.remote import _private

        p = _private.rpc_pickler()
        had = dict(vars(p))
        serialize, deserialize = p.serialize, p.deserialize

        def sent(obj):
            data, tensors = serialize(obj)
            self._saw(obj, list(tensors))
            return data, tensors

        def received(data, table):
            obj = deserialize(data, table)
            self._saw(obj, list(table))
            return obj

        p.serialize, p.deserialize = sent, received

        def undo():
            for k in ("serialize", "deserialize"):
                if k in had:
                    setattr(p, k, had[k])
                else:
                    vars(p).pop(k, None)

        self.undo = undo

    def on_train_end(self, trainer, pl_module):
        self.undo()

    def _saw(self, obj, tensors):
        self.tensors += [(str(t.dtype), tuple(t.shape), t.nbytes) for t in tensors]
        todo, seen = [obj], 0
        while todo and seen < 5000:
            v = todo.pop()
            seen += 1
            name = type(v).__name__
            if name in ("Call", "Answer") and dataclasses.is_dataclass(v):
                (self.calls if name == "Call" else self.answers).append(
                    (type(v.rng).__name__, [tuple(t.shape) for t in v.tensors]))
            elif isinstance(v, (list, tuple)):
                todo.extend(v)
            elif isinstance(v, dict):
                todo.extend(v.values())
            elif hasattr(v, "args") and hasattr(v, "func"):  # torch's PythonUDF
                todo.extend(v.args)

    def seen(self):
        return {"tensors": self.tensors, "calls": self.calls, "answers": self.answers}


def _placed(workers):
    pl.seed_everything(0)
    audit = Audit()
    strategy = SomatizeStrategy(place={"encoder": "worker"}, workers=workers)
    model = Noisy()
    _, losses, weights = fit(model, strategy, _data(), max_epochs=2, callbacks=[audit])
    return {"losses": losses, "weights": weights, "vals": model.vals,
            "rng": torch.get_rng_state(), "audit": audit.seen(),
            "traffic": tuple(strategy.traffic())[1:]}


def _one_piece(callbacks):
    pl.seed_everything(0)
    model = Noisy()
    _, losses, weights = fit(model, "auto", _data(), max_epochs=2, callbacks=callbacks)
    return {"losses": losses, "weights": weights, "vals": model.vals,
            "rng": torch.get_rng_state()}


def derived(out):
    """The oracle (one piece, DerivedRNG), the placed fit with no RNG state sent, the
    placed fit that sends it, and plain one piece (whose dropout draws otherwise)."""
    got = {"oracle": _one_piece([DerivedRNG(["encoder"], key="run-7")]),
           "derived": _placed({"worker": Worker.embedded(rng="derived", rng_key="run-7")}),
           "sent": _placed(None), "plain": _one_piece([]),
           "other_key": _one_piece([DerivedRNG(["encoder"], key="run-8")])}
    torch.save(got, out)
