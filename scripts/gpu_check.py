"""The steps of ``scripts/gpu_check.sh`` (run it, not this): each in its own process with
its own time limit, each one's figures appended to one file, a summary line per step.

    python scripts/gpu_check.py --out gpu_check.txt [--dry-run]

``--dry-run``: on CPU, the same steps small (the device maps need CUDA: said, not run),
each forked from one warm process that imported torch and Lightning once (somatize's fork
server), not five fresh interpreters. Exit 0 when every step passed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = str(Path(__file__).resolve())

ENVIRONMENT = r"""
import importlib, platform, sys
import torch
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
major, minor = (int(p) for p in torch.__version__.split(".")[:2])
assert (major, minor) >= (2, 11), f"torch {torch.__version__}: this check needs 2.11 or later"
if (major, minor) < (2, 13):
    print(f"torch {torch.__version__} accepted for this run (the project asks 2.13)")
for name in ("lightning", "safetensors", "cloudpickle", "tqdm", "numpy", "blake3"):
    m = importlib.import_module(name)
    print(name, getattr(m, "__version__", "?"), "(stand-in)" if "gpu_shim" in
          (getattr(m, "__file__", "") or "") else "")
import somatize.lightning  # the package imports on what is here
"""

# tests/test_private.py's pins, without pytest where it is not installed
PRIVATE = r"""
import contextlib, inspect, re, sys, tempfile, types
from pathlib import Path
try:
    import pytest
except ImportError:
    pytest = types.ModuleType("pytest")
    @contextlib.contextmanager
    def raises(kind, match=None):
        try:
            yield
        except kind as e:
            assert match is None or re.search(match, str(e)), (match, str(e))
        else:
            raise AssertionError(f"did not raise {kind}")
    pytest.raises = raises
    pytest.fixture = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
    sys.modules["pytest"] = pytest
import test_private as t
failed = 0
for name, fn in vars(t).items():
    if not name.startswith("test_") or not callable(fn):
        continue
    args = {p: Path(tempfile.mkdtemp()) for p in inspect.signature(fn).parameters}
    try:
        fn(**args)
        print("ok", name)
    except Exception as e:
        failed += 1
        print("FAILED", name, type(e).__name__, str(e)[:300])
sys.exit(1 if failed else 0)
"""


CODE = {"environment": ENVIRONMENT, "private": PRIVATE}  # `gpu_check.py --code NAME` runs one


def step(report, title: str, argv: list[str], limit: float, warm=None) -> bool:
    """Run one step as its own process (forked from ``warm``, a fork server, where it
    can); its output and outcome go into the report."""
    t = time.monotonic()
    proc = warm.popen(argv[1:], dict(os.environ), str(ROOT), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True) if warm is not None else None
    if proc is None:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=limit)
        text, ok = out + err, proc.returncode == 0
        why = "" if ok else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        text, ok, why = out + err, False, f"over its {limit:.0f} s"
    took = time.monotonic() - t
    line = f"== {title}: {'ok' if ok else 'FAILED ' + why} ({took:.1f} s)"
    print(line, flush=True)
    report.write(f"{line}\n{text.rstrip()}\n\n")
    report.flush()
    if not ok:
        print(text[-2000:], flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", help="the file the figures go to (required)")
    ap.add_argument("--dry-run", action="store_true", help="on CPU, small")
    ap.add_argument("--code", choices=sorted(CODE), help="(a step: run its code)")
    args = ap.parse_args()
    if args.code:
        exec(compile(CODE[args.code], f"<gpu_check {args.code}>", "exec"), {})
        return 0
    if not args.out:
        ap.error("the following arguments are required: --out")
    py, dry = sys.executable, args.dry_run
    warm = None
    if dry:  # the steps' imports once: each step is still a process of its own
        from somatize.remote._forks import ForkServer

        warm = ForkServer.start(["torch", "torch.distributed.rpc", "lightning.pytorch"],
                                wait=False)
    device = "cpu" if dry else "cuda:0"
    results = []
    with open(args.out, "w") as report:
        report.write(f"gpu_check {'--dry-run ' if dry else ''}at {time.ctime()}, "
                     f"{os.uname().nodename}\n\n")
        steps = [
            ("0. what this python holds", [py, HERE, "--code", "environment"], 45),
            ("1. private names (tests/test_private.py)", [py, HERE, "--code", "private"], 90),
            (f"2. TensorPipe on {device}", [py, "scripts/gpu_tensorpipe.py", device], 90),
            (f"3. drop-in on {device} ({'32-true' if dry else '32-true, bf16-mixed, 16-mixed'})",
             [py, "tests/dropin_precision_runs.py", "gpu", os.devnull, device], 150),
            ("4. bench_split", [py, "scripts/bench_split.py", "--repeats",
                                "1" if dry else "3", "--steps", "2" if dry else "10"], 90),
        ]
        for title, argv, limit in steps:
            results.append(step(report, title, argv, limit * (2.5 if dry else 1), warm))
            if not results[0]:
                break  # nothing else runs on a python that lacks what is needed
        if warm is not None:
            warm.close()
        said = f"{sum(results)} of {len(steps)} steps passed"
        report.write(said + "\n")
    print(said, "; figures in", args.out)
    return 0 if all(results) and len(results) == len(steps) else 1


if __name__ == "__main__":
    sys.exit(main())
