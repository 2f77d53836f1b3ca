"""What a placed module's per-call look at itself costs when nothing changed: the look
``Link.forward`` takes before each call (weights written here, structure, hooks put on
children, modes, ``requires_grad``, attributes of any kind), timed alone on the classic
autoencoder's encoder (tests/dropin_models.py) and on Lightning's demo Transformer, to
set beside a placed step (``scripts/bench_dropin.py``). Also what the worker adds to each
call that asks for a gradient: the walk of the call's graph over there that finds an
argument used more than once (``_there.fans``: each use's gradient then comes back apart).

    python scripts/bench_placed_check.py            # microseconds per look, median of 7
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def look_cost(module: torch.nn.Module, n: int = 2000) -> float:
    """Microseconds per look at ``module`` when nothing changed (median of 7 runs)."""
    from somatize.torch.placed._module_ops import Sent
    from somatize.torch.placed._routing import Routing

    class Stand:  # what Routing asks of a Link
        name, host, fitting = "encoder", "worker", True

        def forward(self, *a, **k):
            return None

    stand = Stand()
    stand.module = module
    routing = Routing(stand)
    routing.install()
    sent = Sent(module, "encoder")
    ops: list = []
    sent.writes(ops), routing.hooks(ops), sent.settings(ops)  # the first call sends all
    runs = []
    for _ in range(7):
        ops = []
        t = time.perf_counter()
        for _ in range(n):
            sent.writes(ops)
            routing.hooks(ops)
            sent.settings(ops)
        runs.append((time.perf_counter() - t) / n * 1e6)
        assert not ops, ops  # nothing changed, nothing queued
    routing.uninstall()
    return statistics.median(runs)


def walk_cost(module: torch.nn.Module, x: torch.Tensor, n: int = 200) -> float:
    """Microseconds per ``fans`` walk of one call's graph (median of 7 runs)."""
    from somatize.torch.placed._fans import fans

    leaf = x.detach().requires_grad_()
    out = module(leaf)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            fans(outs, [leaf])
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    from dropin_models import AutoEncoder
    from lightning.pytorch.demos.transformer import Transformer

    for name, module in (("autoencoder encoder", AutoEncoder().encoder),
                         ("demo Transformer", Transformer(vocab_size=64))):
        count = sum(1 for _ in module.modules())
        look = look_cost(module)  # (before the walk's forward)
        x = torch.randn(16, 64) if name.startswith("auto") else torch.randint(0, 64, (8, 12))
        walk = walk_cost(module, x) if name.startswith("auto") else walk_cost(
            lambda t, m=module: m(t.long(), t.long()), x.float())
        print(f"{name} ({count} modules): {look:.1f} us per call; the walk over "
              f"there {walk:.1f} us")


if __name__ == "__main__":
    main()
