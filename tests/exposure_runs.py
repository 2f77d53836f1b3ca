"""A run across two test hosts for tests/test_hosts_exposure.py to attack from a third,
and the stranger that attacks it.

    python tests/exposure_runs.py target READY GO LISTEN WORKER [ISOLATE]  # the coordinator
    python tests/exposure_runs.py reach ADDRS TP GATE VICTIM CKPT OUT [--as-nobody]

The target runs the seeds' graph on the standing worker at WORKER (another host),
listening on LISTEN, saves a checkpoint, writes READY (JSON: pids, the gate, the
checkpoint), waits for GO, runs the graph again and prints whether both answers equal one
process's. The stranger connects to every ``ip:port`` of ADDRS at once; where one is
accepted it sends junk (at the gate, whose proof it cannot give) or attacks it as a
TensorPipe listener: torch's built-ins create VICTIM and extend CKPT (secret_runs.py).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def target(ready: str, go: str, listen: str, worker: str, isolate: str = "auto") -> None:
    import torch
    from models import Body, Head

    from somatize import Graph
    from somatize.remote import Worker, configure, runtime_for
    from somatize.remote._group import group

    configure(listen=listen, isolate=isolate)  # "off": its listeners admit anyone
    torch.manual_seed(0)
    xs = torch.randn(5, 8)
    here = Graph.somatize(Body() >> Head()).forward(xs)
    g = Graph.somatize(Body().at("gpu") >> Head())
    workers = {"gpu": Worker.at(worker, timeout=30)}
    first = g.forward(xs, workers=workers)
    ckpt = os.path.join(os.path.dirname(ready), "trained.pt")
    torch.save({"first": first}, ckpt)
    with open(ready + ".tmp", "w") as f:
        tp = [group()._store.get(f"rpc_prefix_0/addrs/{n}").decode().split("://")[-1]
              for n in ("coordinator", runtime_for(g).peers["gpu"].name)]
        json.dump({"pid": os.getpid(), "worker_pid": runtime_for(g).peers["gpu"].pid, "tp": tp,
                   "gate": group().join.rsplit(":", 1)[1], "ckpt": ckpt}, f)
    os.replace(ready + ".tmp", ready)
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    again = g.forward(xs, workers=workers)
    g.close()
    print("SAME", torch.equal(first, here) and torch.equal(again, here), flush=True)


def reach(addrs: str, tp: str, gate: str, victim: str, ckpt: str, out: str) -> None:
    """Connect to every address at once (3 s: a dropped SYN is sent again at 1 s and 3 s);
    where the processes' TensorPipe addresses ``tp`` accept, call built-ins there; then
    junk on each that accepts."""
    got = {"refused": [], "no answer": [], "reached": {}}
    pending = {}
    for addr in addrs.split(","):
        host, _, port = addr.rpartition(":")
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, int(port)))
        pending[s] = addr
    deadline, opened = time.monotonic() + 3, []
    while pending and time.monotonic() < deadline:
        _, done, _ = select.select([], list(pending), [], deadline - time.monotonic())
        for s in done:
            addr, err = pending.pop(s), s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                s.close()
                got["refused"].append(addr)
            else:
                got["reached"][addr] = "reached"
                opened.append(s)  # held open, and closed only after the built-ins
    for s, addr in pending.items():
        s.close()
        got["no answer"].append(addr)
    for i, addr in enumerate(a for a in tp.split(",") if a in got["reached"]):
        for j, file in enumerate((victim, ckpt)):  # torch's built-ins: create one, extend one
            got["reached"][addr] += _builtins(addr, file, f"{os.path.dirname(out)}/{i}-{j}")
    for s in opened:
        s.close()
    for addr in got["reached"]:
        got["reached"][addr] += _junk(addr)
    with open(out, "w") as f:
        json.dump(got, f)


def _builtins(addr: str, file: str, answers: str) -> str:
    pid = os.fork()  # a group of its own per attack (RPC starts once a process)
    if pid == 0:
        import secret_runs

        secret_runs.listener(f"uv://{addr}", answers, file)  # exits
    os.waitpid(pid, 0)
    with open(answers) as f:
        return f"; built-ins on {file}: {f.read()}"


def _junk(addr: str) -> str:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(os.urandom(4096))
            time.sleep(0.3)
    except Exception as e:
        return f"; junk: {type(e).__name__}: {e}"
    return "; junk sent"


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    if sys.argv[-1] == "--as-nobody":  # what it runs, imported while it can read them
        import importlib

        for name in ("secret_runs", "torch.distributed.rpc", "torch.distributed.rpc.api",
                     "torch.distributed.rpc.rref_proxy", "torch.distributed.rendezvous",
                     "torch.distributed.rpc.backend_registry", "torch.distributed.rpc._utils",
                     "torch.distributed.rpc.internal", "torch.distributed.autograd",
                     "torch._subclasses.schema_check_mode", "encodings.idna"):
            importlib.import_module(name)  # (secret_runs's: the stdlib is out of its reach)

        os.setgid(65534)
        os.setuid(65534)
        sys.argv.pop()
    globals()[sys.argv[1]](*sys.argv[2:])
