"""scripts/gpu_check.sh, the one call prepared for the machine a GPU is lent on, runs here
on CPU as it would there (--dry-run: the same five steps, small, forked from one warm
process that imported torch and Lightning once), with this python and
PYTHONPATH alone, so it cannot rot before a GPU is lent; and the blake3 stand-in it puts
on the path where blake3 is missing answers the calls somatize makes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(1200)  # five steps, each its own process: a minute on an idle machine
def test_the_gpu_check_runs_its_five_steps_on_cpu_and_writes_their_figures_to_one_file(
        tmp_path):
    out = tmp_path / "gpu_check.txt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                          env={**env, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out)},
                          capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    text = out.read_text()
    steps = re.findall(r"^== (\d)\. .*?: (ok|FAILED)", text, re.M)
    assert steps == [(str(i), "ok") for i in range(5)], (steps, said[-3000:])
    assert "5 of 5 steps passed" in text
    assert re.search(r"^ok test_every_private_rpc_name_relied_on_exists", text, re.M), text
    assert "sent and answered on cpu; equal to here: True" in text, text
    assert "32-true {'losses equal': True, 'weights equal': True}" in text, text
    assert "bit-identical losses: split True" in text, text


def test_the_blake3_stand_in_answers_what_somatize_asks_of_blake3():
    sys.path.insert(0, str(ROOT / "scripts" / "gpu_shim"))
    try:
        import importlib.util

        shim = importlib.import_module("blake3")
        if "gpu_shim" not in shim.__file__:  # the real one was imported first: load ours
            spec = importlib.util.spec_from_file_location(
                "shim", ROOT / "scripts" / "gpu_shim" / "blake3.py")
            shim = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(shim)
    finally:
        sys.path.pop(0)
    b = shim.blake3
    h = b()
    h.update(b"ab")
    assert h.digest() == b(b"ab").digest() and len(h.digest()) == 32
    assert b(b"ab", max_threads=b.AUTO).hexdigest() == b(b"ab").hexdigest()
    keyed = b(b"ab", key=bytes(32)).digest(16)
    assert len(keyed) == 16 and keyed != b(b"ab").digest(16)
    assert b(memoryview(b"ab")).digest() == b(b"ab").digest()
