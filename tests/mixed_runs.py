"""A LightningModule that uses both routes at once, plain and under SomatizeStrategy, in
a fresh process (RPC starts once per process); tests/test_mixed_routes.py reads what it
saves.

    python tests/mixed_runs.py mixed OUT.pt
    python tests/mixed_runs.py interrupted MARKER   # Ctrl-C at the fourth step
    python tests/mixed_runs.py refused OUT.json     # the graph route refuses at setup
    python tests/mixed_runs.py math OUT.json        # two parts, one worker process
"""

import json
import os
import signal
import sys
import threading

import lightning.pytorch as pl
import oracle
import torch
import torch.utils.data as tud
from scenario import play
from torch import nn
from torch.nn import functional as F

from examples.digits_graph import Body, Head
from somatize import Graph, Refused
from somatize.lightning import SomatizeStrategy
from somatize.torch import GraphModule, Split, node
from somatize.torch._session import Session


class Mixed(pl.LightningModule):
    """A plain submodule placed by name (``encoder``) feeding a GraphModule whose body
    node is placed with ``.at("worker")``; the head runs here."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.net = GraphModule(Graph.somatize(Body(32).at("worker") >> Head(32)))

    def training_step(self, batch, i):
        x, y = batch
        loss = F.cross_entropy(self.net(self.encoder(x)), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(96, 64, generator=g), torch.randint(0, 10, (96,), generator=g)
    return tud.DataLoader(tud.TensorDataset(x, y), batch_size=16)


def _refused(call) -> str:
    try:
        call()
    except TypeError as e:
        return str(e)
    return ""


class Shared(pl.Callback):
    """What the strategy's session holds, read during fit (at the third step)."""

    def __init__(self):
        self.seen = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != 2 or self.seen is not None:
            return
        s = trainer.strategy
        session, placed, graph = s.session(), s.part("encoder"), s.part("net")
        self.seen = {
            "parts": sorted(session.parts), "one": placed.session is session is graph.session,
            "placed": placed.name, "graph": graph.name, "none": s.part("head") is None,
            "refused": _refused(lambda: s.session("encoder")),
            "traffic": [session.traffic(), placed.traffic(), graph.traffic()],
            "open": [not placed.closed, not graph.closed]}


class CtrlC(pl.Callback):
    """Ctrl-C at the fourth step, once the workers' pids are written to ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 3:
            where = trainer.strategy.where()  # the placed module's and the body node's
            pids = {*where["encoder"], *where["net.body"]}
            with open(self.marker, "w") as f:
                json.dump(sorted(pids), f)
            os.kill(os.getpid(), signal.SIGINT)  # Python's own Ctrl-C, here and now


def fit(strategy, *more):
    pl.seed_everything(0)
    model = Mixed()
    _, losses = oracle.fit(model, strategy, data(), max_epochs=2, callbacks=more)
    return losses, oracle.weights(model)


def mixed(out):
    plain_losses, plain = fit("auto")
    strategy, shared = SomatizeStrategy(place={"encoder": "worker"}), Shared()
    split_losses, split = fit(strategy, shared)
    after = {"parts": {n: p.closed for n, p in strategy.session().parts.items()},
             "traffic": strategy.traffic()}
    strategy.close()  # what stayed open for a validate or test after fit ends now
    after["closed"] = strategy.session().closed
    pl.seed_everything(0)
    fresh = {k: v.detach().clone() for k, v in Mixed().state_dict().items()}
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "fresh": fresh, "where": strategy.where(), "pid": os.getpid(),
                "seen": shared.seen, "after": after}, out)


def refused(out):
    """The graph route refuses (clipping with a node trained by a Split) after the placed
    route has opened: what the placed route did at setup is undone, the session closed."""
    model = Mixed()
    strategy = SomatizeStrategy(place={"encoder": "worker"},
                                trains={"body": Split(torch.optim.SGD, lr=0.1)})
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, strategy=strategy, gradient_clip_val=1.0)
    said = None
    try:
        trainer.fit(model, data())
    except Refused as e:
        said = str(e)
    x = torch.rand(2, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        here = model.encoder(x)
        plain = torch.tanh(torch.nn.functional.linear(x, model.encoder[0].weight,
                                                      model.encoder[0].bias))
    with open(out, "w") as f:
        json.dump({"said": said, "own_forward": "forward" not in vars(model.encoder),
                   "same": torch.equal(here, plain), "closed": strategy.session().closed,
                   "routes": len(strategy.routes)}, f)


class Unsent(nn.Module):
    """A module that cannot travel (a lock in it): refused before anything is sent."""

    def __init__(self):
        super().__init__()
        self.lin, self.lock = nn.Linear(64, 64), threading.Lock()

    def forward(self, x):
        return self.lin(x).tanh()


class TwoGraphs(pl.LightningModule):
    """Two GraphModules; the second one's placed node does not pickle."""

    def __init__(self):
        super().__init__()
        self.a = GraphModule(Graph.somatize(Body(32).at("worker") >> Head(32)))
        self.b = GraphModule(Graph.somatize(node(Unsent()).named("odd").at("worker")))

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.a(self.b(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def refused_later(out):
    """The graph route refuses its second GraphModule: the first one runs here again."""
    model = TwoGraphs()
    strategy = SomatizeStrategy()
    said = None
    try:
        pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, strategy=strategy).fit(model, data())
    except Refused as e:
        said = str(e)
    x = torch.rand(4, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = model.a(x)
    with open(out, "w") as f:
        json.dump({"said": said, "shape": list(y.shape), "closed": strategy.session().closed},
                  f)


def _settings(live):
    return torch.are_deterministic_algorithms_enabled(), os.getpid()


def math(out):
    """Two parts of one session on one worker process: the math settings each sends,
    where the other part changed them in between."""
    g1 = Graph.somatize(node(nn.Linear(2, 2)).named("one").at("w"))
    g2 = Graph.somatize(node(nn.Linear(2, 2)).named("two").at("w"))
    session = Session()
    a, b = session.open("a", g1), session.open("b", g2)
    got = {"where": session.where()}
    try:
        torch.use_deterministic_algorithms(False)
        a.follow_math()
        b.follow_math()
        torch.use_deterministic_algorithms(True)
        b.follow_math()
        got["b"] = b.call("w", _settings)
        torch.use_deterministic_algorithms(False)
        a.follow_math()
        got["a"] = a.call("w", _settings)
        torch.use_deterministic_algorithms(True)
        b.follow_math()  # b's own settings again, those it sent last: sent all the same
        got["b_again"] = b.call("w", _settings)
    finally:
        torch.use_deterministic_algorithms(False)
        session.close()
    got["closed"] = session.closed
    with open(out, "w") as f:
        json.dump(got, f)


def interrupted(marker):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even as a background job
    fit(SomatizeStrategy(place={"encoder": "worker"}, trace=f"{marker}.trace.json"),
        CtrlC(marker))


if __name__ == "__main__":
    play(globals(), sys.argv)
