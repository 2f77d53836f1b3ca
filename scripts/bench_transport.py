"""TensorPipe's own floor on this machine, with nothing of somatize in the way: a bare
``rpc_sync`` of 1 and 64 MB to a second process (and the same back), beside an in-process
``copy_`` measured in the same run, for one receiver setting given on the command line.

    python scripts/bench_transport.py PORT CHANNELS_JSON ENV_JSON
    python scripts/bench_transport.py 29911 null '{}'                          # 4 KB pages
    python scripts/bench_transport.py 29911 null '{"THP_MEM_ALLOC_ENABLE": "1"}'
    python scripts/bench_transport.py 29911 '["basic"]' '{}'                   # no cma

ENV_JSON is added to the second process's environment (the receiver of "send"); the
uv transport as somatize uses it, TensorPipe's channel choice unless CHANNELS_JSON names
some. Prints one JSON line: GB/s one way there and back per size, a no-op's µs, copy_'s GB/s.
"""

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402


def opts(port: int, channels):
    kw = {"_transports": ["uv"]}
    if channels:
        kw["_channels"] = channels
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=8, **kw)


def make(n: int) -> torch.Tensor:
    return torch.zeros(n)


def med(fn, n: int = 15) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    if sys.argv[1] == "worker":
        rpc.init_rpc("w", rank=1, world_size=2,
                     rpc_backend_options=opts(int(sys.argv[2]), json.loads(sys.argv[3])))
        rpc.shutdown()
        return
    port, channels, env = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    p = subprocess.Popen([sys.executable, __file__, "worker", str(port), sys.argv[2]],
                         env={**os.environ, **env})
    rpc.init_rpc("c", rank=0, world_size=2, rpc_backend_options=opts(port, channels))
    got = {}
    for mb in (1, 64):
        t = torch.randn(mb * (1 << 18))
        there = med(lambda t=t: rpc.rpc_sync("w", len, args=(t,)))
        back = med(lambda mb=mb: rpc.rpc_sync("w", make, args=(mb * (1 << 18),)))
        got[f"{mb} MB there, back"] = (round(mb / 1024 / there, 2), round(mb / 1024 / back, 2))
    noop = med(lambda: rpc.rpc_sync("w", len, args=((),)), 50)
    buf, src = torch.empty(1 << 24), torch.randn(1 << 24)
    copy = med(lambda: buf.copy_(src))
    print(json.dumps({"channels": channels, "receiver env": env, "GB/s": got,
                      "noop_us": round(noop * 1e6), "copy_ GB/s": round(0.0625 / copy, 2),
                      "load": round(os.getloadavg()[0], 2)}))
    rpc.shutdown()
    p.wait(timeout=60)


if __name__ == "__main__":
    main()
