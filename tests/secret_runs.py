"""A run for tests/test_secret.py to attack, and the stranger that attacks it.

    python tests/secret_runs.py target READY GO [LISTEN [ISOLATE [REFUSED]]] # a run: says
                                                         # where it listens, waits for GO
    python tests/secret_runs.py rendezvous HOST:PORT OUT [REFUSED] # plain torch joins
                                                         # through it
    python tests/secret_runs.py listener ADDR OUT        # TensorPipe straight at a listener
    python tests/secret_runs.py ports PORTS FILE OUT     # every port: reach it, attack it

The target runs the seeds' graph on an embedded worker, writes READY (JSON: the
rendezvous, the pids, each process's TensorPipe address as ``ss`` would show it), waits
for GO, runs the graph again and prints whether both answers equal one process's.
The target creates REFUSED once it has refused a join; a stranger's rendezvous waits for
it (or 25 s). A stranger writes OUT (JSON): what each attempt answered. A call that ran
would have created OUT + ".ran" (as whoever runs the target).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
from models import Body, Head

from somatize import Graph
from somatize.remote import runtime_for


class _Refusals(logging.Handler):
    """Creates ``path`` when somatize says it refused a join."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record):
        if record.getMessage().startswith("refused a join"):
            open(self.path, "w").close()


def target(ready: str, go: str, listen: str = "", isolate: str = "auto",
           refused: str = "") -> None:
    from somatize.remote import configure
    from somatize.remote._group import group

    if refused:
        logging.getLogger("somatize").addHandler(_Refusals(refused))
    if listen:  # opened to a network (another test host reaches it)
        configure(listen=listen)
    configure(isolate=isolate)

    torch.manual_seed(0)
    xs = torch.randn(5, 8)
    here = Graph.somatize(Body() >> Head()).forward(xs)
    g = Graph.somatize(Body().at("gpu") >> Head())
    first = g.forward(xs)
    grp = group()
    addrs = {n: grp._store.get(f"rpc_prefix_0/addrs/{n}").decode()
             for n in ("coordinator", runtime_for(g).peers["gpu"].name)}
    ckpt = os.path.join(os.path.dirname(ready), "trained.pt")
    _train_and_save(xs, ckpt)
    from somatize.remote._secret import run_key

    with open(ready + ".tmp", "w") as f:  # the key too, only so that the test scans for it
        json.dump({"join": grp.join, "pid": os.getpid(), "addrs": addrs, "ckpt": ckpt,
                   "isolated": grp.netns is not None,
                   "worker_pid": runtime_for(g).peers["gpu"].pid,
                   "key": run_key().hex()}, f)
    os.replace(ready + ".tmp", ready)
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    again = g.forward(xs)
    g.close()
    print("SAME", torch.equal(first, here) and torch.equal(again, here), flush=True)


def _train_and_save(xs, ckpt: str) -> None:
    from torch.nn.functional import cross_entropy

    from somatize.torch import Split, Trainer, parameters

    g = Graph.somatize(Body().at("gpu") >> Head())
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    with Trainer(g, cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                 trains=trains) as t:
        t.fit([(xs, torch.tensor([0, 1, 2, 0, 1]))], epochs=1, progress=False)
        torch.save(t.state_dict(), ckpt)


def _record(out: str, what: dict) -> None:
    with open(out, "w") as f:
        json.dump(what, f)


def _ran(out: str) -> tuple:
    return (os.system, (f"touch {out}.ran",))


def rendezvous(where: str, out: str, refused: str = "") -> None:
    import threading

    import torch.distributed.rpc as rpc

    fn, args = _ran(out)
    got = {}

    def join():
        try:
            rpc.init_rpc("stranger", rank=77, world_size=None,
                         rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                             init_method=where, rpc_timeout=10, _transports=["uv"]))
            got["joined"] = True
            got["call"] = repr(rpc.rpc_sync("coordinator", fn, args=args, timeout=10))
        except BaseException as e:  # what plain torch answers a stranger
            got["refused"] = f"{type(e).__name__}: {e}"[:300]

    t = threading.Thread(target=join, daemon=True)
    t.start()
    # torch's TCPStore client retries for 30 min: a stranger gives up once the run says it
    # refused it (each retry is refused too), or after 25 s
    deadline = time.monotonic() + 25
    while t.is_alive() and time.monotonic() < deadline and not (
            refused and os.path.exists(refused)):
        t.join(timeout=0.05)
    if t.is_alive():
        said = "the run refused it" if refused and os.path.exists(refused) else "no join " \
            "within 25 s"
        got["refused"] = f"{said}: the rendezvous answered nothing torch understands"
    _record(out, got)
    os._exit(0)


def listener(addr: str, out: str, victim_file: str = "") -> None:
    import importlib

    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc.api import _get_current_rpc_agent

    own = dist.HashStore()  # a group of its own, with the target's address written in
    rdv = importlib.import_module("torch.distributed.rendezvous")
    rdv.register_rendezvous_handler("own", lambda url, **kw: iter([(own, 0, -1)]))
    rpc.init_rpc("stranger", rank=0, world_size=None,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method="own://", rpc_timeout=10, _transports=["uv"]))
    own.set("rpc_prefix_0/addrs/victim", addr)
    _get_current_rpc_agent()._update_group_membership(
        rpc.WorkerInfo("victim", 1), [], {}, True)
    fn, args = _ran(out)
    got = {}
    secret = os.path.join(os.path.dirname(out), "only-root-reads")
    for what, f, a, kw in (("python", fn, args, {}),
                           ("builtin", torch.add, (torch.ones(2), torch.ones(2)), {}),
                           ("from_file", torch.from_file, (secret, False, 6),
                            {"dtype": torch.uint8}),
                           ("create", torch.from_file, (victim_file or secret + ".made", True,
                                                        1 << 20), {"dtype": torch.uint8})):
        try:
            got[what] = repr(rpc.rpc_sync("victim", f, args=a, kwargs=kw, timeout=10))
        except BaseException as e:
            got[what] = f"{type(e).__name__}: {e}"[:300]
    for _ in range(200):  # what a stranger's many calls add to the run's log
        try:
            rpc.rpc_sync("victim", fn, args=args, timeout=10)
        except BaseException:
            pass
    _record(out, got)
    os._exit(0)


def _host_listens(port: int) -> bool:
    # a port some other process of this machine's own network listens on is not the run's:
    # it is never attacked (another user's program, not the target)
    for proto in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{proto}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                    return True
    return False


def ports(ports: str, victim_file: str, out: str) -> None:
    """Try every port the run listens on, as this machine's other users reach them: a TCP
    connection to 127.0.0.1; where one is accepted, a call of torch's built-ins that
    creates ``victim_file`` (torch.from_file, shared), then 4 KB of junk."""
    import socket

    got = {"refused": [], "skipped": [], "reached": {}}
    for port in map(int, ports.split(",")):
        if _host_listens(port):
            got["skipped"].append(port)
            continue
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            got["refused"].append(port)
            continue
        except OSError as e:
            got["reached"][port] = f"no connection, but not refused: {e}"
            continue
        got["reached"][port] = _attack(port, victim_file)
    _record(out, got)
    os._exit(0)


def _attack(port: int, victim_file: str) -> str:
    import socket
    import subprocess

    said = "reached"
    try:  # in a process of its own: a second group cannot start in this one
        r = subprocess.run([sys.executable, __file__, "listener", f"127.0.0.1:{port}",
                            victim_file + ".said", victim_file], capture_output=True,
                           text=True, timeout=60)
        said += f"; its built-ins: exit {r.returncode}, {r.stderr[-300:]}"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(os.urandom(4096))
    except Exception as e:
        said += f"; {type(e).__name__}: {e}"
    return said


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[-1] == "--as-nobody":
        # what the stranger imports, imported while it still reads the checkout: a
        # checkout in a 0700 directory (mktemp -d) is out of nobody's reach
        import importlib
        import threading  # noqa: F401

        for name in ("torch.distributed.rpc", "torch.distributed.rpc.api",
                     "torch.distributed.rpc.rref_proxy", "torch.distributed.rendezvous",
                     "torch.distributed.rpc.backend_registry", "torch.distributed.rpc._utils",
                     "torch.distributed.rpc.internal", "torch.distributed.autograd",
                     "torch._subclasses.schema_check_mode",  # (a builtin op's call)
                     "encodings.idna", "socket", "subprocess"):  # (reaching a port)
            importlib.import_module(name)
        os.setgid(65534)
        os.setuid(65534)
        sys.argv.pop()
    globals()[sys.argv[1]](*sys.argv[2:])
