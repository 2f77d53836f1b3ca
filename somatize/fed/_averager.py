"""A study's averager of its own choosing (``[fedavg] averager = "NAME"``): a standing
process of another organization (``somatize hub --average-only``, its own certificate,
CN ``NAME``) that serves no shared module. At each round barrier every owner sends it its
parts, its rows and the owners the hub's barrier averaged (what the hub answered it);
once each of those owners is there it answers the weighted average (``average``: the
one function the hub and the oracles use). The hub then never receives the parts.

    averager = StudyAverager(StudyConfig.load("ct-2027.toml"))
    kind, fields, avg = averager.handle("hospital-a", "RoundEnd", {...}, parts)
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .._errors import Refused
from ._average import average
from ._config import StudyConfig
from ._frames import Refusal
from ._rounds import average_digest


class StudyAverager:
    """One study's averages; ``handle`` is thread-safe (the transport's threads call it)."""

    def __init__(self, config: StudyConfig):
        self.cfg = config
        self.cond = threading.Condition()
        self.rounds: dict[int, dict[str, Any]] = {}

    def handle(self, owner: str, kind: str, fields: dict, tensors: dict[str, torch.Tensor]
               ) -> tuple[str, dict, dict[str, torch.Tensor]]:
        """One ``RoundEnd`` from ``owner`` (the name its certificate proves): its parts'
        average once every owner the hub averaged has sent its own; or ``Refusal``."""
        cfg = self.cfg
        if owner not in cfg.owners:
            raise Refusal("identity", f"{owner!r} is not an owner of study {cfg.name!r}")
        if fields.get("owner", owner) != owner:
            raise Refusal("identity", f"a message naming owner {fields.get('owner')!r} came "
                                      f"with {owner!r}'s certificate")
        if kind != "RoundEnd":
            raise Refusal("kind", f"study {cfg.name!r}'s averager takes RoundEnd only; "
                                  f"send {kind} to the study's hub")
        if fields.get("digest") != cfg.digest():
            raise Refusal("digest", f"owner {owner!r} ends a round of study {cfg.name!r} with "
                                    f"digest {fields.get('digest')!r}; the averager's is "
                                    f"{cfg.digest()!r}: use the study's own definition")
        r, rows, owners = fields.get("round"), fields.get("rows"), fields.get("owners")
        if (not isinstance(r, int) or not isinstance(rows, int) or rows <= 0
                or not isinstance(owners, list) or owner not in owners
                or not set(owners) <= set(cfg.owners)):
            raise Refusal("round", f"owner {owner!r}'s RoundEnd names round {r!r}, rows "
                                   f"{rows!r} and owners {owners!r}: give the round, this "
                                   "owner's rows in it and the owners the hub averaged")
        with self.cond:
            got = self.rounds.setdefault(r, {"owners": sorted(owners), "parts": {},
                                             "rows": {}, "answer": None,
                                             "first": time.monotonic()})
            if sorted(owners) != got["owners"]:
                raise Refusal("owners", f"owner {owner!r} says the hub averaged {owners} in "
                                        f"round {r}; another said {got['owners']}")
            if owner in got["rows"]:
                raise Refusal("round", f"owner {owner!r} sent round {r}'s parts twice")
            first = next(iter(got["parts"].values()), None)
            if first is not None and list(first) != list(tensors):
                raise Refusal("parts", f"owner {owner!r}'s parts are not the others' "
                                       f"({sorted(set(first) ^ set(tensors))[:5]})")
            got["parts"][owner], got["rows"][owner] = dict(tensors), rows
            self.cond.notify_all()
            while got["answer"] is None:
                if set(got["rows"]) == set(got["owners"]):
                    try:
                        avg = average(got["parts"], got["rows"])
                    except Refused as e:
                        raise Refusal("parts", str(e)) from None
                    got["answer"], got["parts"] = (average_digest(avg), avg), {}
                    for old in [k for k in self.rounds if k < r - 1]:
                        del self.rounds[old]  # answered long ago
                    self.cond.notify_all()
                    break
                if time.monotonic() - got["first"] > cfg.round_timeout:
                    missing = sorted(set(got["owners"]) - set(got["rows"]))
                    raise Refusal("quorum", f"round {r} of study {cfg.name!r}: owners "
                                            f"{missing} did not bring their parts to the "
                                            f"averager within round_timeout "
                                            f"({cfg.round_timeout}s)")
                self.cond.wait(0.05)
            digest, avg = got["answer"]
        return "Average", {"round": r, "digest": digest}, avg
