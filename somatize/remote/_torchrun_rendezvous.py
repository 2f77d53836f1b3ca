"""How torchrun's ranks meet: somatize's own gated rendezvous, hosted by rank 0 in a
child process, and the run's key every rank derives from the token (or, on one machine
without one, from a file rank 0 makes that only this user reads).

    init_method = rendezvous(rank)     # rank 0 hosts it; every rank proves the key
    drop_key_file()                    # once every rank has joined
"""

from __future__ import annotations

import os

from .._errors import WorkerError


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
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    _sealed.seal(key, loopback(host))  # one host: big tensors through shared memory
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
