"""How to have a worker: the spec a user hands over in ``workers={"gpu": ...}``.

    Worker()                          # embedded: a local process started for this run
    Worker.at("node3:7000")           # standing: a daemon there starts one for this run
    Worker.rank(1)                    # torchrun: rank 1 of the same script serves

A worker runs the code it is sent (the graph is pickled to it, and classes
defined in ``__main__`` travel by value): make it reachable only by whom you trust.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import WorkerError

DEFAULT_TIMEOUT = 60.0  # seconds any one call to a worker may take before it is an error
RNG = ("sent", "derived")  # what a placed module's randomness over there draws from


@dataclass(frozen=True)
class Worker:
    """Where the nodes placed on one host run, and how long a call to it may take.

    Args:
        address: ``"host:port"`` of a standing daemon (``python -m somatize.worker``).
        rank: the torchrun rank that serves (ranks >= 1 of the same script).
        store: a directory the worker keeps what it runs in (embedded workers only;
            a standing daemon is given its own with ``--store``).
        timeout: seconds one call may take (a stretch, a provision) before it fails.
        threads: math threads over there (default: as many as here, so a node gives
            exactly what it gives here).
        device: where a placed module computes over there (``"cpu"``, ``"cuda:1"``);
            default: a torchrun rank's ``LOCAL_RANK`` GPU, else ``cuda:0`` where there is
            one, else ``cpu``.
        rng: what a placed module's randomness (dropout) over there draws from.
            ``"sent"`` (default): this process's RNG state travels with each call and
            comes back advanced, so the run is exactly one piece's. ``"derived"``, for a
            worker of another organization: no RNG state crosses (from it a worker could
            predict this process's next shuffle, or any noise drawn here); each call
            draws from a generator seeded by ``HMAC(rng_key, module path/stage/global
            step/batch/dataloader/call)`` (``somatize.lightning.DerivedRNG`` is its
            one-piece oracle; docs/security.md). It is the placed route's (``place=``).
        rng_key: the key ``"derived"`` seeds derive from (a run's seed, not a secret).
    """

    address: str | None = None
    torchrun_rank: int | None = None
    store: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    threads: int | None = None
    device: str | None = None
    rng: str = "sent"
    rng_key: str = "somatize"

    def __post_init__(self):
        if self.rng not in RNG:
            raise WorkerError(f"Worker(rng={self.rng!r}): say 'sent' (this process's RNG "
                              "state travels with each call) or 'derived' (none crosses; "
                              "the placed module draws from a derived generator)")

    @classmethod
    def at(cls, address: str, *, timeout: float = DEFAULT_TIMEOUT,
           threads: int | None = None, device: str | None = None, rng: str = "sent",
           rng_key: str = "somatize") -> Worker:
        """A standing worker: the daemon listening at ``"host:port"``."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise WorkerError(
                f"Worker.at({address!r}): give the daemon's address as 'host:port', "
                "e.g. Worker.at('127.0.0.1:7000')"
            )
        return cls(address=address, timeout=timeout, threads=threads, device=device, rng=rng,
                   rng_key=rng_key)

    @classmethod
    def rank(cls, rank: int, *, timeout: float = DEFAULT_TIMEOUT) -> Worker:
        """A torchrun worker: rank ``rank`` (>= 1) of the same script."""
        if rank < 1:
            raise WorkerError(f"Worker.rank({rank}): rank 0 is the coordinator; use 1 or more")
        return cls(torchrun_rank=rank, timeout=timeout)

    @classmethod
    def embedded(cls, *, store: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 threads: int | None = None, device: str | None = None, rng: str = "sent",
                 rng_key: str = "somatize") -> Worker:
        """A local worker process started on 127.0.0.1 for the graph or trainer using it."""
        return cls(store=None if store is None else str(store), timeout=timeout,
                   threads=threads, device=device, rng=rng, rng_key=rng_key)

    @property
    def kind(self) -> str:
        if self.address is not None:
            return "standing"
        if self.torchrun_rank is not None:
            return "torchrun"
        return "embedded"
