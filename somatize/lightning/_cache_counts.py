"""What a cache counted: a keeper wrapper counting hits and misses (Counting), by stage of
a run (training, validation, test, predict), and
whether a train loader shuffles (then no whole batch repeats).

    counts.begin("val", (hits, misses)); ...; counts.end("val", (hits, misses))  # (2, 1)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import RandomSampler

from .._keeper import Kept, items_of_keeper


class StageCounts:
    """Hits and misses by stage: each stage counts from its begin to its end, and a stage
    nested in another (validation inside a training epoch) is not counted twice."""

    def __init__(self):
        self.marks: dict[str, tuple[int, int]] = {}
        self.inside: dict[str, tuple[int, int]] = {}  # counted by stages nested in it
        self.totals: dict[str, tuple[int, int]] = {}  # over every epoch, by stage
        self.said_shuffle = False

    def begin(self, stage: str, now: tuple[int, int]) -> None:
        """Stage ``stage`` begins; ``now`` is the count of (hits, misses) so far."""
        self.marks[stage] = now
        self.inside[stage] = (0, 0)

    def end(self, stage: str, now: tuple[int, int]) -> tuple[int, int]:
        """Stage ``stage`` ends: its own (hits, misses), nested stages' left out."""
        then = self.marks.pop(stage, now)
        nested = self.inside.pop(stage, (0, 0))
        got = (now[0] - then[0] - nested[0], now[1] - then[1] - nested[1])
        for outer in self.inside:  # still open: what this stage counted is not theirs
            self.inside[outer] = (self.inside[outer][0] + got[0], self.inside[outer][1] + got[1])
        total = self.totals.get(stage, (0, 0))
        self.totals[stage] = (total[0] + got[0], total[1] + got[1])
        return got


def shuffles(loader: Any) -> bool:
    """Whether a train loader draws a new order each epoch (its sampler, or its batch
    sampler's)."""
    for ld in loader if isinstance(loader, (list, tuple)) else [loader]:
        for sampler in (getattr(ld, "sampler", None),
                        getattr(getattr(ld, "batch_sampler", None), "sampler", None)):
            if isinstance(sampler, RandomSampler) or getattr(sampler, "shuffle", False) is True:
                return True
    return False


class Counting:
    """A keeper that counts what it was asked: a hit is a name found, a miss one not."""

    def __init__(self, keeper: Any):
        self.keeper = keeper
        self.hits = 0
        self.misses = 0

    def get_many(self, names: Sequence[str]) -> list[Kept | None]:
        got = self.keeper.get_many(names)
        found = sum(g is not None for g in got)
        self.hits += found
        self.misses += len(got) - found
        return got

    def put(self, name: str, value: Any, meta: Mapping[str, str] | None = None) -> bool:
        return self.keeper.put(name, value, meta)

    def names(self, prefix: str = "") -> Iterator[str]:
        return self.keeper.names(prefix)

    def items(self) -> Any:
        return items_of_keeper(self.keeper)
