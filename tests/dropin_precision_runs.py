"""Drop-in runs of the numbers' settings: precision and clipping, a worker's device, the
math settings that travel with each call, and the GPU check (scripts/gpu_check.sh).
Run through tests/dropin_runs.py, or alone:

    python tests/dropin_precision_runs.py precision OUT.pt bf16
"""

import os
import sys

import lightning.pytorch as pl
import torch
from dropin_models import PlainAutoEncoder, digits, fit
from torch import nn
from torch.nn import functional as F

from somatize.lightning import SomatizeStrategy

_TINY = [1e-310]  # a subnormal double, read as zero where denormals are flushed


class Probe(nn.Module):
    """Answers, beside its output, the math settings of the process it runs in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 8)

    def forward(self, x):
        return {"y": self.lin(x), "threads": torch.get_num_threads(),
                "precision": torch.get_float32_matmul_precision(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "benchmark": torch._C._get_cudnn_benchmark(),  # (a CudnnModule does not pickle)
                "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                "mkldnn": torch.backends.mkldnn.enabled,
                "fastpath": torch.backends.mha.get_fastpath_enabled(),
                "flush": _TINY[0] * 1.0 == 0.0, "nnpack": torch._C._get_nnpack_enabled()}


class Settings(pl.LightningModule):
    """Changes the math settings between batches; keeps what the encoder saw."""

    SET = [(1, "high", True, True), (2, "medium", False, False), (1, "highest", False, True)]

    def __init__(self):
        super().__init__()
        self.encoder = Probe()
        self.head = nn.Linear(8, 64)
        self.seen: list[tuple] = []

    def on_train_batch_start(self, batch, i):
        threads, precision, deterministic, benchmark = self.SET[i % len(self.SET)]
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.benchmark = benchmark
        # the CPU's own: oneDNN's convolutions, attention's fast path
        torch.backends.mkldnn.enabled = benchmark
        torch.backends.mha.set_fastpath_enabled(deterministic)
        torch.set_flush_denormal(not benchmark)
        torch._C._set_nnpack_enabled(deterministic)  # NNPACK's convolutions
        if deterministic:  # as Lightning's deterministic=True does, for cuBLAS
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        else:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)

    def training_step(self, batch, i):
        x = batch[0]
        out = self.encoder(x)
        self.seen.append((out["threads"], out["precision"], out["deterministic"],
                          out["benchmark"], out["cublas"], out["mkldnn"], out["fastpath"],
                          out["flush"], out["nnpack"]))
        return F.mse_loss(self.head(out["y"]), x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def settings(out):
    """The math settings here travel with each call (and a Worker(threads=...) keeps its
    own count)."""
    from somatize.remote import Worker

    seen = {}
    for name, workers in (("followed", None), ("own", {"worker": Worker.embedded(threads=2)})):
        model = Settings()
        fit(model, SomatizeStrategy(place={"encoder": "worker"}, workers=workers), digits(),
            max_steps=6)
        seen[name] = model.seen
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    torch.backends.mkldnn.enabled = True
    torch.backends.mha.set_fastpath_enabled(True)
    torch.set_flush_denormal(False)
    torch._C._set_nnpack_enabled(True)
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.save(seen, out)


PRECISION = {
    "bf16": {"precision": "bf16-mixed"},
    "norm": {"gradient_clip_val": 0.05},
    "value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    "bf16-norm": {"precision": "bf16-mixed", "gradient_clip_val": 0.05},
    "bf16-true": {"precision": "bf16-true"},
}


def precision(out, case):
    """Plain Lightning and the strategy under one precision / clipping setting."""
    if case == "16":  # Lightning makes 16-mixed on CPU bf16: ask for float16 by the plugin
        from lightning.pytorch.plugins import MixedPrecision

        def scaled():  # a scale that overflows float16 at first: steps are skipped
            return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler(
                "cpu", init_scale=2.0**24))]}

        kw, kw_twice = scaled(), scaled()
    else:
        kw = kw_twice = PRECISION[case]
    pl.seed_everything(0)
    _, as_is, _ = fit(PlainAutoEncoder(), "auto", digits(), max_epochs=2, limit_val_batches=1)
    pl.seed_everything(0)
    t, plain_losses, plain = fit(PlainAutoEncoder(), "auto", digits(), max_epochs=2,
                                 limit_val_batches=1, **kw)
    scales = [getattr(getattr(t.precision_plugin, "scaler", None), "get_scale", lambda: None)()]
    pl.seed_everything(0)
    strategy = SomatizeStrategy(place={"encoder": "worker"})
    t, split_losses, split = fit(PlainAutoEncoder(), strategy, digits(), max_epochs=2,
                                 limit_val_batches=1, **kw_twice)
    scales.append(getattr(getattr(t.precision_plugin, "scaler", None), "get_scale",
                          lambda: None)())
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "as_is": as_is, "scales": scales,
                "ran": strategy.where(), "pid": os.getpid()}, out)


def devices(out):
    """A worker given device='cpu' explicitly trains exactly; one given a GPU it does not
    have says so, naming the device."""
    from somatize import WorkerError
    from somatize.remote import Worker

    pl.seed_everything(0)
    _, plain_losses, plain = fit(PlainAutoEncoder(), "auto", digits(), max_epochs=1)
    pl.seed_everything(0)
    on_cpu = SomatizeStrategy(place={"encoder": "worker"},
                              workers={"worker": Worker.embedded(device="cpu")})
    _, split_losses, split = fit(PlainAutoEncoder(), on_cpu, digits(), max_epochs=1)
    said = ""
    try:
        fit(PlainAutoEncoder(), SomatizeStrategy(
            place={"encoder": "worker"}, workers={"worker": Worker.embedded(device="cuda:0")}),
            digits(), max_epochs=1)
    except WorkerError as e:
        said = str(e)
    torch.save({"plain": (plain_losses, plain), "split": (split_losses, split),
                "said": said}, out)


def gpu(out, device="cuda:0"):
    """On a machine with a GPU (scripts/gpu_check.sh): the local half on ``device``, the
    encoder on a worker on ``device``, under 32-true, bf16-mixed and 16-mixed: equal to
    plain? ``cpu`` (its --dry-run): 32-true alone, one epoch of a few batches."""
    from somatize.remote import Worker

    report = {}
    cuda = device.startswith("cuda")
    try:
        data = digits() if cuda else digits(n=64)
    except ImportError:  # the GPU machine has no scikit-learn: 64-pixel rows of noise
        import torch.utils.data as tud

        x = torch.rand(96, 64, generator=torch.Generator().manual_seed(0))
        data = tud.DataLoader(tud.TensorDataset(x), batch_size=16)
    for precision in ("32-true", "bf16-mixed", "16-mixed") if cuda else ("32-true",):
        kw = {"accelerator": "gpu" if cuda else "cpu", "devices": 1, "precision": precision,
              "max_epochs": 1}
        pl.seed_everything(0)
        _, plain_losses, plain = fit(PlainAutoEncoder(), "auto", data, **kw)
        pl.seed_everything(0)
        strategy = SomatizeStrategy(place={"encoder": "worker"},
                                    workers={"worker": Worker.embedded(device=device)})
        _, split_losses, split = fit(PlainAutoEncoder(), strategy, data, **kw)
        same = all(torch.equal(plain[k].cpu(), split[k].cpu()) for k in plain)
        report[precision] = {"losses equal": split_losses == plain_losses,
                             "weights equal": same}
        print(precision, report[precision], flush=True)
    torch.save(report, out)
    if not all(all(r.values()) for r in report.values()):
        raise SystemExit(f"not equal to plain Lightning on {device}: {report}")


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
