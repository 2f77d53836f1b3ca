"""TensorPipe on a device, as somatize would use it (step 2 of scripts/gpu_check.sh):
two processes in a *dynamic* group (world_size=None, as somatize's embedded workers join),
a device map DEVICE -> DEVICE, a tensor sent and answered on the device, an RRef of a
device tensor (RRefs of CUDA tensors are unsupported by torch: CPU staging is the way
then) and a matmul there equal to the same one here, TF32 off on both sides.

    python scripts/gpu_tensorpipe.py cuda:0     # cpu: the same, without device maps
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def _matmul(a, b):
    return a @ b


def _make(n, device):
    return torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(device)


def _exact():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)


def _options(port, device, peer):
    kw = {"init_method": f"tcp://127.0.0.1:{port}", "_channels": ["cuda_basic", "basic"]
          if device.startswith("cuda") else None}
    if device.startswith("cuda"):
        kw["device_maps"] = {peer: {device: device}}
        kw["devices"] = [device]
    return rpc.TensorPipeRpcBackendOptions(**{k: v for k, v in kw.items() if v is not None})


def _worker(port, device, done):
    _exact()
    rpc.init_rpc("worker", rank=1, world_size=None,
                 rpc_backend_options=_options(port, device, "coordinator"))
    done.wait(240)  # in a dynamic group shutdown leaves at once: serve until told
    rpc.shutdown()


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    _exact()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=_worker, args=(port, device, done))
    proc.start()
    rpc.init_rpc("coordinator", rank=0, world_size=None,
                 rpc_backend_options=_options(port, device, "worker"))
    failed = 0
    try:
        deadline = time.monotonic() + 60
        while True:  # a dynamic group's join is no barrier: wait until the worker is known
            try:
                rpc.get_worker_info("worker")
                break
            except RuntimeError:
                if time.monotonic() > deadline or not proc.is_alive():
                    raise
                time.sleep(0.1)
        a, b = _make(512, device), _make(512, device).T.contiguous()
        there = rpc.rpc_sync("worker", _matmul, args=(a, b), timeout=60)
        print(f"sent and answered on {there.device}; equal to here: "
              f"{torch.equal(there.cpu(), (a @ b).cpu())}")
        failed += not torch.equal(there.cpu(), (a @ b).cpu())
        try:
            ref = rpc.remote("worker", _make, args=(64, device))
            got = ref.to_here(timeout=60)
            print(f"RRef of a {device} tensor: to_here on {got.device}, "
                  f"equal: {torch.equal(got.cpu(), _make(64, 'cpu'))}")
        except Exception as e:  # the documented limit: stage through the CPU
            print(f"RRef of a {device} tensor refused ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]}); CPU staging:")
            ref = rpc.remote("worker", _make, args=(64, "cpu"))
            got = ref.to_here(timeout=60).to(device)
            print(f"  staged through the CPU, equal: {torch.equal(got.cpu(), _make(64, 'cpu'))}")
        del ref, got  # before shutdown: no leaked RRef reported
        if not device.startswith("cuda"):
            print("device maps: not tried on cpu (they need CUDA)")
    finally:
        done.set()
        rpc.shutdown()
        proc.join(60)
    return 1 if failed or proc.exitcode else 0


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.exit(main())
