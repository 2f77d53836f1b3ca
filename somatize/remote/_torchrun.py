"""torchrun: rank 0 of the script is the coordinator, the other ranks serve as workers.

    # train.py, launched with: torchrun --nproc-per-node=2 train.py
    from somatize.remote import serve_if_worker
    serve_if_worker()          # ranks >= 1 serve here until rank 0 is done, then exit
    ...                        # rank 0 goes on: g.forward(x) runs "gpu" on rank 1

By default the hosts a graph places nodes on are served by ranks 1, 2, ... in the
order the graph first uses them; ``serve_if_worker({"gpu": 1, "cpu": 2})`` (or the
environment variable ``SOMATIZE_RANKS="gpu=1,cpu=2"``) names them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from .._errors import WorkerError

log = logging.getLogger(__name__)


def serve_if_worker(ranks: Mapping[str, int] | None = None) -> bool:
    """Under torchrun, serve as a worker on ranks >= 1 (never returning); on rank 0 (or
    outside torchrun) return at once: False outside torchrun, True on the coordinator.

    Args:
        ranks: host name -> rank; default: the graph's hosts in first-use order.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return False
    rank = int(os.environ["RANK"])
    ranks = dict(ranks) if ranks is not None else _from_env()
    bad = {h: r for h, r in ranks.items() if not 1 <= r < world}
    if bad:
        raise WorkerError(f"ranks {bad}: a worker's rank is between 1 and {world - 1} "
                          f"(torchrun --nproc-per-node={world})")
    from ._group import group

    g = group()
    if rank == 0:
        g.static, g.world = ranks, world
        return True
    import torch.distributed.rpc as rpc

    from ._settings import backend_options, settings

    name = {r: h for h, r in ranks.items()}.get(rank, f"rank{rank}")
    rpc.init_rpc(name, rank=rank, world_size=world,
                 rpc_backend_options=backend_options(rendezvous(rank), settings))
    log.info("rank %d serves as worker %r", rank, name)
    rpc.shutdown(graceful=True)  # serves until every rank, the coordinator too, is done
    raise SystemExit(0)


def rendezvous(rank: int) -> str:
    """The init_method of this torchrun rank: somatize's own gated rendezvous, hosted by
    rank 0 (``_gate``), with the run's key every rank derives from the token
    (``run_key``). Only the gate's port goes through torchrun's store, which anyone who
    reaches it reads and writes: a port written there by a stranger leads to a gate that
    cannot prove the key, and the rank refuses it."""
    import torch.distributed as dist

    from . import _membership, _sealed, _secret
    from ._settings import keep_on_loopback, loopback, settings

    key = run_key()
    _secret.use_key(key, "torchrun")
    _sealed.seal(key)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if loopback(host):
        keep_on_loopback()
    torchrun_store = next(dist.rendezvous("env://", rank=rank,
                                          world_size=int(os.environ["WORLD_SIZE"])))[0]
    if rank == 0:
        port = _gate_process(host, key, settings["timeout"])
        torchrun_store.set("somatize/gate", str(port))
    else:
        port = int(torchrun_store.get("somatize/gate"))
    return _membership.join_through(host, port, key, settings["timeout"])


def _gate_process(host: str, key: bytes, timeout: float) -> int:
    # rank 0's agent waits for the others inside C++ holding the GIL: a gate in this
    # process would never answer them, so it lives in a child of its own
    import subprocess
    import sys

    from ._secret import RUN_KEY_ENV

    proc = subprocess.Popen([sys.executable, "-m", "somatize.remote._gate", host,
                             str(timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, RUN_KEY_ENV: key.hex()})
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        raise WorkerError(f"rank 0's rendezvous did not start (exit {proc.poll()}): its "
                          "stderr is above")
    _keep.append(proc)  # its stdin closes when this process exits: it exits then
    return int(line)


_keep: list = []  # rank 0's gate process, and the key file it made


def drop_key_file() -> None:
    """Remove the key file rank 0 made, once every rank has read it (they have all
    joined)."""
    for k in _keep:
        if isinstance(k, str):
            try:
                os.unlink(k)
            except FileNotFoundError:
                pass


def run_key() -> bytes:
    """The run's key under torchrun: from the token every rank is given; without one, on
    one machine, made by rank 0 and handed over in a file only this user reads."""
    from ._secret import derive, token

    rid = f"torchrun {os.environ.get('TORCHELASTIC_RUN_ID', '')} {os.environ.get('MASTER_PORT')}"
    tok = token()
    if tok is not None:
        return derive(tok, rid)
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        raise WorkerError("torchrun across machines: give every rank the same token "
                          "(SOMATIZE_TOKEN_FILE=<a file, mode 0600, on each machine> or "
                          "SOMATIZE_TOKEN) so that they can prove to each other that they "
                          "belong to the run (docs/security.md)")
    from ._secret import make_token_file, read_token_file

    # every local rank is a child of the same torchrun agent: its pid names the file
    path = os.path.join(_private_tmp(), f"torchrun-{os.getppid()}-{os.environ['MASTER_PORT']}")
    if int(os.environ["RANK"]) == 0:
        tok = make_token_file(path)
        _keep.append(path)  # removed once every rank has joined (drop_key_file)
    else:
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise WorkerError(f"rank 0 wrote no run key to {path} within 60 s")
            time.sleep(0.02)
        time.sleep(0.05)  # written whole: it is one short write after an O_EXCL create
        tok = read_token_file(path)
    return derive(tok, rid)


def _private_tmp() -> str:
    import stat
    import tempfile

    d = os.path.join(tempfile.gettempdir(), f"somatize-{os.geteuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise WorkerError(f"{d} is not a directory only this user may enter: remove it, or "
                          "give every rank SOMATIZE_TOKEN_FILE")
    return d


def _from_env() -> dict[str, int]:
    text = os.environ.get("SOMATIZE_RANKS", "").strip()
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        host, _, r = item.partition("=")
        if not r.isdigit():
            raise WorkerError(f"SOMATIZE_RANKS={text!r}: write it as 'gpu=1,cpu=2'")
        out[host] = int(r)
    return out
