"""What a worker costs, measured side by side in one run on loopback (medians of repeats).

    python scripts/bench_remote.py                 # the default transport (uv), ~1 minute
    python scripts/bench_remote.py --quick         # fewer repeats
    python scripts/bench_remote.py --compare       # each transport/channel in its own run
    python scripts/bench_remote.py --spin          # this process's math threads busy-wait

1. A forward of an MLP body (784->1024->1024, batch 256) placed on a local worker
   against the same forward here (target: <= 1.15x), with the breakdown: the call
   overhead (an empty stretch), the transfer (the same bytes in and out, no compute)
   and the compute over there.
2. Activation transfer throughput for 1, 16 and 64 MB tensors sent to the worker, as a
   fraction of an in-process ``copy_`` into a preallocated tensor (the physical limit
   here); ``clone()`` (a fresh buffer, as the receiver gets) beside it.
3. The per-call overhead of an empty stretch against a bare ``rpc_sync`` no-op.

RPC starts once per process (pytorch#46491), so ``--compare`` runs this script once
per transport setting, each in a fresh process. The worker's math threads sleep when
idle (somatize starts it with ``OMP_WAIT_POLICY=PASSIVE``); this process's do too unless
``--spin`` (libgomp reads it once, before torch is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# libgomp reads this once, when torch is imported: this process's math threads sleep
# between ops, as the workers' do (somatize starts them so), unless --spin keeps libgomp's
# default (busy-waiting ~3 ms after each op, on the cores the worker computes on)
if "--spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch reads this once, at its first allocation: large tensors received here land in
# huge pages, as a worker's do (--no-thp: 4 KB pages; docs/performance.md)
if "--no-thp" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from torch import nn  # noqa: E402

from somatize import Graph  # noqa: E402
from somatize._engine import Stretch  # noqa: E402
from somatize.remote import Worker, _serve, configure, runtime_for  # noqa: E402
from somatize.torch import node  # noqa: E402


def median_ms(fn, repeats: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _forward_once(live, x):
    # runs over there: the body's compute alone, one forward per call as a stretch does
    t = time.perf_counter()
    live["sequential"].forward(x, None)
    return (time.perf_counter() - t) * 1e3


def _answer(live, x, out):
    return out  # the bytes of the activation, back, with no compute


def throughput(name: str, mb: int, n: int) -> dict:
    """One way to worker ``name``, against copy_ into a preallocated tensor and clone()."""
    t = torch.randn(mb * (1 << 20) // 4)
    buf = torch.empty_like(t)
    send = median_ms(lambda: rpc.rpc_sync(name, len, args=(t,)), n)
    copy = median_ms(lambda: buf.copy_(t), n)
    clone = median_ms(lambda: t.clone(), n)

    def gbs(ms):
        return mb / 1024 / (ms / 1e3)

    return {"ms": send, "GB/s": gbs(send), "copy_GB/s": gbs(copy), "clone_GB/s": gbs(clone),
            "of_copy": copy / send, "of_clone": clone / send}


def run(repeats: int) -> dict:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    x = torch.randn(256, 784)
    here = Graph.somatize(node(mlp))
    g = Graph.somatize(node(mlp).at("gpu"))
    rt = runtime_for(g, {"gpu": Worker.embedded(timeout=120)})
    assert torch.equal(g.forward(x), here.forward(x)), "remote != here"
    peer = rt.peers["gpu"]
    res: dict = {"threads": torch.get_num_threads()}

    # 1. the body's forward, remote against here, interleaved so both see the same machine
    local, remote = [], []
    for _ in range(5):
        local.append(median_ms(lambda: here.forward(x), repeats))
        remote.append(median_ms(lambda: g.forward(x), repeats))
    res["forward_here_ms"] = statistics.median(local)
    res["forward_remote_ms"] = statistics.median(remote)
    res["ratio"] = res["forward_remote_ms"] / res["forward_here_ms"]
    empty = Stretch(host="gpu", nodes=(), given={}, given_keys={}, inputs={}, naming=False,
                    training=False, wanted=())
    res["overhead_ms"] = median_ms(lambda: rt.submit(empty).result(), repeats * 2)
    y = here.forward(x)
    res["transfer_ms"] = median_ms(lambda: rt.call("gpu", _answer, x, y), repeats) \
        - res["overhead_ms"]
    res["compute_there_ms"] = statistics.median(
        rt.call("gpu", _forward_once, x) for _ in range(repeats))

    # 2. throughput: one way to the worker, against copy_ and clone() here
    for mb in (1, 16, 64):
        n = max(3, repeats // (1 if mb == 1 else 2 if mb == 16 else 4))
        res[f"send_{mb}MB"] = throughput(peer.name, mb, n)

    # 3. an empty stretch against a bare rpc_sync no-op
    res["noop_rpc_ms"] = median_ms(lambda: rpc.rpc_sync(peer.name, _serve.noop), repeats * 2)
    res["empty_stretch_ms"] = res["overhead_ms"]
    g.close()
    return res


def show(name: str, r: dict) -> None:
    print(f"\n== {name} (math threads {r['threads']} here and there; OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', '(libgomp default)')} here, PASSIVE there; "
          f"THP_MEM_ALLOC_ENABLE {os.environ.get('THP_MEM_ALLOC_ENABLE', '-')} here, 1 there; "
          f"load {os.getloadavg()[0]:.2f}) ==")
    print(f"1. body forward: here {r['forward_here_ms']:.2f} ms, on a worker "
          f"{r['forward_remote_ms']:.2f} ms -> ratio {r['ratio']:.3f} (target <= 1.15)")
    print(f"   breakdown: call overhead {r['overhead_ms']:.2f} ms + transfer "
          f"{r['transfer_ms']:.2f} ms (0.8 MB in, 1 MB out) + compute there "
          f"{r['compute_there_ms']:.2f} ms")
    print("2. transfer, one way to the worker:")
    for mb in (1, 16, 64):
        s = r[f"send_{mb}MB"]
        print(f"   {mb:>2} MB: {s['ms']:7.2f} ms = {s['GB/s']:.2f} GB/s; copy_ here "
              f"{s['copy_GB/s']:.2f} GB/s, clone() {s['clone_GB/s']:.2f} GB/s -> "
              f"{s['of_copy']:.2f} of copy_, {s['of_clone']:.2f} of clone()")
    print(f"3. empty stretch {r['empty_stretch_ms'] * 1e3:.0f} us vs bare rpc_sync no-op "
          f"{r['noop_rpc_ms'] * 1e3:.0f} us -> {r['empty_stretch_ms'] / r['noop_rpc_ms']:.2f}x")


SETTINGS = {
    "uv (default)": {"transports": ["uv"]},
    "uv + basic channel": {"transports": ["uv"], "channels": ["basic"]},
    "uv + mpt_uv channel": {"transports": ["uv"], "channels": ["mpt_uv"]},
    "shm + cma (TensorPipe's default)": {"transports": ["shm", "uv"], "channels": ["cma"]},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compare", action="store_true", help="each transport setting in turn")
    ap.add_argument("--spin", action="store_true", help="keep libgomp's busy-wait here")
    ap.add_argument("--no-thp", action="store_true",
                    help="tensors received here in 4 KB pages (no THP_MEM_ALLOC_ENABLE)")
    ap.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    repeats = 7 if args.quick else 20
    if args.compare:
        for name, s in SETTINGS.items():
            cmd = [sys.executable, __file__, "--settings", json.dumps(s), "--json"]
            cmd += [a for a in ("--quick", "--spin", "--no-thp")
                    if getattr(args, a[2:].replace("-", "_"))]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                 env=dict(os.environ))
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode or not line:
                print(f"\n== {name}: failed ==\n{out.stderr[-2000:]}")
                continue
            show(name, json.loads(line[-1]))
        return 0
    if args.settings:
        configure(**json.loads(args.settings))
    r = run(repeats)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"$ {' '.join(sys.argv)}")
    show("uv (default)" if not args.settings else args.settings, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
