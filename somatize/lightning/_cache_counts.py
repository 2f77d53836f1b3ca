"""What a cache counted in each stage of a run (training, validation, test, predict), and
whether a train loader shuffles (then no whole batch repeats).

    counts.begin("val", (hits, misses)); ...; counts.end("val", (hits, misses))  # (2, 1)
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import RandomSampler


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
