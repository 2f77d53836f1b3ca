"""The group's transport settings, set before the first run starts RPC in this process.

    configure(timeout=30, transports=["uv"])   # before the first run, if at all

The defaults were chosen by measuring (``scripts/bench_remote.py``; docs/performance.md,
"Transport"): the ``uv`` transport, TensorPipe's own channel choice.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from .._errors import WorkerError
from ._worker import DEFAULT_TIMEOUT

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"  # rank 0's RPC name
settings: dict[str, Any] = {
    "listen": "127.0.0.1",  # where the rendezvous and the coordinator listen
    "transports": ["uv"],  # shm keeps a core spinning in every process
    "channels": None,  # TensorPipe's own choice
    "rpc_threads": 16,
    "timeout": DEFAULT_TIMEOUT,
    # keep a one-machine run's listeners to its own processes (_exposure)
    "isolate": os.environ.get("SOMATIZE_ISOLATE", "auto"),
}
_started = [False]  # set by the group once RPC runs: settings can no longer change


def configure(**given: Any) -> None:
    """Set the group's transport options before the first run starts it.

    Args:
        listen: the address the coordinator binds (``"127.0.0.1"``); workers on other
            machines need one they can reach (and ``TP_SOCKET_IFNAME`` set to its
            interface).
        transports: TensorPipe transports, e.g. ``["uv"]`` or ``["shm", "uv"]``.
        channels: TensorPipe channels, e.g. ``["basic"]`` (None: TensorPipe's choice).
        rpc_threads: threads each process serves calls with.
        timeout: seconds a join or a shutdown may take.
        isolate: ``"auto"`` (default): a run whose processes are all on this machine
            listens inside a network namespace of its own, which no other user reaches,
            where the system allows it, and otherwise says once what is exposed and the
            fix; ``"require"``: refuse to start where it cannot; ``"off"``: never, silently.
            ``SOMATIZE_ISOLATE`` in the environment sets the default.
    """
    unknown = set(given) - set(settings)
    if unknown:
        raise WorkerError(f"configure() knows {sorted(settings)}, not {sorted(unknown)}")
    if _started[0]:
        raise WorkerError("configure() must be called before the first run starts RPC in "
                          "this process (it cannot be restarted: pytorch#46491)")
    settings.update(given)


def worker_options() -> dict[str, Any]:
    """The settings a worker is started with: the transport's, not where or whether
    this coordinator listens."""
    return {k: v for k, v in settings.items() if k not in ("listen", "isolate")}


def backend_options(init_method: str, opts: dict):
    """The TensorPipe options every process of the group is started with."""
    import torch.distributed.rpc as rpc

    kw: dict[str, Any] = {}
    if opts.get("transports"):
        kw["_transports"] = list(opts["transports"])
    if opts.get("channels"):
        kw["_channels"] = list(opts["channels"])
    return rpc.TensorPipeRpcBackendOptions(
        init_method=init_method, num_worker_threads=opts.get("rpc_threads", 16),
        rpc_timeout=opts.get("timeout", DEFAULT_TIMEOUT), **kw)


def loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address."""
    return host in ("localhost", "::1") or host.startswith("127.")


def loopback_iface() -> str:
    """This machine's loopback interface (for ``TP_SOCKET_IFNAME``)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def keep_on_loopback(env: dict | None = None) -> None:
    """Point TensorPipe at the loopback interface in ``env`` (default: this process's
    environment): a run that listens on loopback never listens anywhere else, whatever
    ``TP_SOCKET_IFNAME`` said (said once, when it said another interface)."""
    env = os.environ if env is None else env
    lo, was = loopback_iface(), env.get("TP_SOCKET_IFNAME")
    if was and was != lo:
        log.warning("TP_SOCKET_IFNAME=%s is not used: this run listens on loopback only, so "
                    "TensorPipe listens on %s. To reach other machines, call "
                    "somatize.remote.configure(listen='<an address on %s>')", was, lo, was)
    env["TP_SOCKET_IFNAME"] = lo


# what a serving process starts with unless the environment says otherwise (_spawn.py)
SERVING_ENV = {"THP_MEM_ALLOC_ENABLE": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "SOMATIZE_SERVING": "1"}  # its lines are its own: somatize._log


def serving_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``SERVING_ENV``'s settings where it says nothing of them."""
    return {**SERVING_ENV, **env}
