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
from ._torchrun_rendezvous import rendezvous

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


def _from_env() -> dict[str, int]:
    text = os.environ.get("SOMATIZE_RANKS", "").strip()
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        host, _, r = item.partition("=")
        if not r.isdigit():
            raise WorkerError(f"SOMATIZE_RANKS={text!r}: write it as 'gpu=1,cpu=2'")
        out[host] = int(r)
    return out
