"""One owner-step over a study's link (gRPC, mutual TLS, typed frames, to a ``somatize
hub`` on loopback) against the same step on today's placed route (torch.distributed.rpc
to a local worker; and with ``Worker(rng="derived")``, no RNG state sent), side by side in
one run: the same U-shaped LightningModule, its trunk placed with ``place={"trunk": study.shared}`` or ``place={"trunk": "worker"}``.

    python scripts/bench_splitfed.py                  # 5 alternations of 30 steps each
    python scripts/bench_splitfed.py --repeats 7 --steps 40 --width 1024 --batch 256

Prints each route's median milliseconds per training step (steps after the first 5 of a
fit), the median of each alternation, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from somatize.fed import Study  # noqa: E402
from somatize.fed._certs import issue, make_ca  # noqa: E402
from somatize.lightning import SomatizeStrategy  # noqa: E402
from somatize.remote import Worker  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self, width: int):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.trunk = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.head(torch.relu(self.trunk(self.stem(x)))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Clock(pl.Callback):
    def __init__(self):
        self.times: list[float] = []

    def on_train_batch_start(self, *a):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, *a):
        self.times.append(time.perf_counter() - self.t0)


def fit(place, args, workers=None) -> float:
    torch.manual_seed(0)
    n = args.steps * args.batch
    x, y = torch.randn(n, 64), torch.randint(0, 10, (n,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=args.batch)
    clock = Clock()
    trainer = pl.Trainer(max_epochs=1, strategy=SomatizeStrategy(place=place, workers=workers),
                         logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[clock])
    trainer.fit(Net(args.width), loader)
    return statistics.median(clock.times[5:]) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-splitfed-"))
    make_ca(d)
    for p in ("hub", "owner"):
        issue(d, p)
    spec = (f'owners = ["owner"]\nmodule = "torch.nn:Linear"\nschedule = "v2"\n'
            f'kwargs = {{ in_features = {args.width}, out_features = {args.width} }}\n'
            f'optimizer = {{ class = "torch.optim.SGD", lr = 0.01 }}\n')
    tomls = []
    for r in range(args.repeats):  # a study per fit: each fit starts at round 0
        tomls.append(d / f"bench{r}.toml")
        tomls[-1].write_text(f'name = "bench{r}"\n' + spec)
    cmd = [sys.executable, "-m", "somatize", "hub", "--listen", "127.0.0.1:0", "--identity",
           str(d / "hub.pem"), "--ca", str(d / "ca.pem"), "--ready", str(d / "port")]
    for t in tomls:
        cmd += ["--study", str(t)]
    hub = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (d / "port").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        address = f"127.0.0.1:{(d / 'port').read_text()}"
        study_ms, placed_ms, derived_ms = [], [], []
        derived = {"worker": Worker.embedded(rng="derived")}
        for r, t in enumerate(tomls):  # the two sides alternate
            study = Study(t, hub=address, owner="owner", identity=d / "owner.pem",
                          ca=d / "ca.pem")
            placed_ms.append(fit({"trunk": "worker"}, args))
            derived_ms.append(fit({"trunk": "worker"}, args, derived))
            study_ms.append(fit({"trunk": study.shared}, args))
            print(f"repeat {r}: placed route {placed_ms[-1]:.2f} ms/step (no RNG state sent: "
                  f"{derived_ms[-1]:.2f}), study link {study_ms[-1]:.2f} ms/step", flush=True)
    finally:
        hub.terminate()
        hub.wait(10)
    s, p = statistics.median(study_ms), statistics.median(placed_ms)
    print(f"width {args.width}, batch {args.batch}: study link {s:.2f} ms/step, placed route "
          f"{p:.2f} ms/step (rng='derived': {statistics.median(derived_ms):.2f}), ratio "
          f"{s / p:.2f} (median of {args.repeats}); load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
