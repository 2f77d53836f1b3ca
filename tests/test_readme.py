"""The README's first screen runs as written (in a fresh process: RPC starts once per
process): the backbone placed on a worker trains there, and the probe over it, cached,
reads the backbone's outputs back from the store."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

CHECK = """
import os
ran = trainer.strategy.where()["backbone"]
assert ran and os.getpid() not in ran, ran
print("backbone ran in", sorted(ran), "cache", cache.hits, cache.misses)
"""


def test_the_readmes_first_example_places_the_backbone_then_reads_it_from_the_store(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert readme[:readme.index(code)].count("\n") < 10, "the example opens the README"
    done = subprocess.run([sys.executable, "-c", code + CHECK], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    # 512 rows a epoch, shuffled, 3 epochs, kept per item: each row computed once, then read
    assert "cache 1024 512" in done.stdout, out[-3000:]
    assert any((tmp_path / ".soma" / "items").iterdir())
    # a plain script, no logging set up: somatize says where the backbone ran and what the
    # cache read back, once each, in its own lines (not in the progress bar's)
    [pid] = re.findall(r"backbone ran in \[(\d+)\]", done.stdout)
    lines = done.stderr.splitlines()
    said = [s for s in lines if s.startswith("module 'backbone' ran in")]
    assert said == [f"module 'backbone' ran in process {pid} (worker 'worker') 16 times"], said
    hits = [s for s in lines if s.startswith("SomatizeCache:")]
    assert hits == ["SomatizeCache: modules ['backbone'] computed their output for 512 items "
                    "and read it from the store .soma for 1024"], hits
    assert "in eval mode at the start of training" not in done.stderr  # the cache's, said
