"""What isolating a run costs at start: a fresh coordinator per sample, the time of its
first forward (an embedded worker started and joined), SOMATIZE_ISOLATE=auto against off,
alternated.

    python scripts/bench_isolation_start.py ROUNDS FORKS   # FORKS: off (fresh workers)
"""
import json
import os
import statistics
import subprocess
import sys

code = r'''
import time, torch, json
from somatize import Graph
from somatize.torch import node
from somatize.remote._group import group
g = Graph.somatize(node(torch.nn.Linear(4, 4)).at("w"))
t = time.perf_counter(); g.forward(torch.ones(2, 4)); first = time.perf_counter() - t
print(json.dumps({"first": first, "isolated": group().netns is not None})); g.close()
'''
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
got = {"auto": [], "off": []}
for _ in range(int(sys.argv[1])):
    for mode in got:
        env = {**os.environ, "SOMATIZE_ISOLATE": mode, "SOMATIZE_FORKS": sys.argv[2]}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, cwd=ROOT)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        assert d["isolated"] == (mode == "auto"), d
        got[mode].append(d["first"])
print({m: [round(x, 3) for x in v] for m, v in got.items()})
print({m: round(statistics.median(v), 3) for m, v in got.items()}, "load", os.getloadavg())
