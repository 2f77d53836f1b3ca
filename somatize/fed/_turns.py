"""The hub's rules for time, under its lock (``StudyHub.cond``): V2's turns, a step in
flight that outlives ``turn_timeout``, and an owner left out of a round. An owner left
out of round ``r`` is told so by name (``Excluded``: the round, and ``r + 1``, the first
round it may attach at again) at its next message; nothing it sends after is applied.

    self._expire()                      # discard the steps in flight past turn_timeout
    self._exclude("c", why="...")       # left out of this round, ledgered
"""

from __future__ import annotations

import logging
import time

from ._frames import Refusal

log = logging.getLogger(__name__)


class Turns:
    """What ``StudyHub`` mixes in (its state: ``cfg``, ``round``, ``pending``,
    ``gone``, ``ledger``, ``turn``, ...)."""

    def _excluded(self, owner: str) -> Refusal:
        """The refusal of anything ``owner`` sends after it was left out."""
        r, why = self.gone[owner]
        return Refusal("excluded", f"owner {owner!r} was left out of round {r} of study "
                                   f"{self.cfg.name!r} ({why}); nothing it sent since was "
                                   f"applied. Its fit stops here: to come back, attach at "
                                   f"round {r + 1} or later, from a checkpoint of that "
                                   "round's barrier", round=r, rejoin=r + 1)

    def _exclude(self, owner: str, why: str) -> None:
        """Leave ``owner`` out of this round (ledgered): the round closes without it."""
        if owner in self.gone:
            return
        self.ledger.append({"round": self.round, "owner": owner, "kind": "excluded"})
        self.gone[owner] = (self.round, why)
        log.warning("study %s: owner %r left out of round %d (%s)", self.cfg.name, owner,
                    self.round, why)

    def _stepping(self) -> list[str]:
        return [o for o in sorted(self.cfg.owners)
                if o not in self.arrived and o not in self.gone]

    def _expire(self) -> None:
        """A step in flight whose Backward did not come within turn_timeout is discarded
        (no optimizer step ran) and its owner left out: lost, or too slow."""
        now = time.monotonic()
        for owner, (step, _, _, since) in list(self.pending.items()):
            if now - since <= self.cfg.turn_timeout:
                continue
            del self.pending[owner]
            self.ledger.append({"round": self.round, "owner": owner, "step": step,
                                "kind": "discarded", "why": "turn_timeout"})
            log.warning("study %s: owner %r's step %d in flight is discarded (no Backward "
                        "within %ss); no optimizer step ran", self.cfg.name, owner, step,
                        self.cfg.turn_timeout)
            with self.compute:
                self._opt(owner).zero_grad(set_to_none=True)
            self._exclude(owner, f"its step {step} had no Backward within turn_timeout "
                                 f"({self.cfg.turn_timeout}s) and was discarded")
            if self.turn is not None and self.turn[0] == owner:
                self.turn = None
            self.free_since = now
            self.cond.notify_all()

    def _next(self, waiting: str) -> str | None:
        stepping = self._stepping()
        if self.cfg.order == "arrival" or not stepping:
            return waiting
        if self.cfg.order == "owner_sequential":
            return stepping[0]
        after = [o for o in stepping if self.last_turn is None or o > self.last_turn]
        return (after or stepping)[0]

    def _take_turn(self, owner: str) -> None:
        deadline = time.monotonic() + self.cfg.round_timeout
        if self.round_open is None:
            self.round_open = time.monotonic()
        while True:
            self._expire()
            if owner in self.gone:
                raise self._excluded(owner)
            if self.turn is None and self.cfg.order != "arrival":
                missing = [o for o in self.cfg.owners
                           if o not in self.attached and o not in self.gone]
                if missing and time.monotonic() - self.round_open < self.cfg.round_timeout:
                    self.cond.wait(0.05)  # a fixed order starts with every owner there
                    continue
                if not self.started:  # the first turn's owner has turn_timeout from now
                    self.started, self.free_since = True, time.monotonic()
            if self.turn is None:
                nxt = self._next(owner)
                if nxt == owner:
                    self.turn = (owner, time.monotonic())
                    return
                if time.monotonic() - self.free_since > self.cfg.turn_timeout:
                    self.ledger.append({"round": self.round, "owner": nxt,
                                        "step": self.steps[nxt], "kind": "skipped"})
                    self.last_turn, self.free_since = nxt, time.monotonic()
                    continue
            if time.monotonic() > deadline:
                raise Refusal("timeout", f"owner {owner!r} waited round_timeout "
                                         f"({self.cfg.round_timeout}s) for its turn")
            self.cond.wait(0.05)
