"""A study's definition, shared by the hub and every owner: who takes part, the shared
module (the hub's own installed code, by dotted path and keyword arguments), its
optimizer, the schedule, and the parts FedAvg averages. Read from a TOML file or a dict.

    cfg = StudyConfig.load("studies/ct-2027.toml")
    cfg.digest()            # what an owner and the hub compare when it attaches
    trunk = cfg.build_module()
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import Refused

SCHEDULES = ("v1", "v2")
ORDERS = ("round_robin", "owner_sequential", "arrival")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """One study. ``module``: ``"package.module:Class"`` on the hub's path; ``kwargs``:
    its arguments; ``init``: ``"seed:N"`` (built after ``torch.manual_seed(N)``);
    ``optimizer``: ``{"class": "torch.optim.SGD", "lr": 0.1}``; ``schedule``: ``"v1"``
    (a copy per owner, averaged each round) or ``"v2"`` (one module, owner-steps in
    turns, in ``order``); ``parts``: the owners' submodules FedAvg averages each round;
    ``quorum``: owners a round needs; timeouts in seconds; ``key``: the secret the
    shared module's seeds derive from (the name when not given); ``rounds``: how many
    rounds the owners run (informational; each owner's ``max_epochs`` or ``max_steps``
    decides); ``round_steps``: a round is that many owner-steps of each owner (its
    batches in order across epochs), or, 0, an epoch; ``averager``: the common name of
    the certificate of the party that averages the parts (``somatize hub
    --average-only``), so that the hub never receives them; None: the hub averages."""

    name: str
    owners: tuple[str, ...]
    module: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    init: str = "seed:0"
    optimizer: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"class": "torch.optim.SGD", "lr": 0.1})
    schedule: str = "v1"
    order: str = "round_robin"
    precision: str = "32-true"
    parts: tuple[str, ...] = ()
    quorum: int = 1
    round_timeout: float = 60.0
    turn_timeout: float = 30.0
    key: str | None = None
    rounds: int = 0  # how many rounds the owners run (0: as their fits say)
    round_steps: int = 0  # a round is this many owner-steps of each owner; 0: an epoch
    averager: str | None = None  # the averager's certificate name; None: the hub averages

    def __post_init__(self):
        where = f"study {self.name!r}"
        if self.schedule not in SCHEDULES:
            raise Refused(f"{where}: schedule = {self.schedule!r}; say one of {SCHEDULES}")
        if self.order not in ORDERS:
            raise Refused(f"{where}: order = {self.order!r}; say one of {ORDERS}")
        if ":" not in self.module:
            raise Refused(f"{where}: module = {self.module!r}; give it as "
                          "'package.module:Class', installed on the hub")
        if not self.init.startswith("seed:") or not self.init[5:].isdigit():
            raise Refused(f"{where}: init = {self.init!r}; say 'seed:N'")
        if self.precision != "32-true":
            raise Refused(f"{where}: precision = {self.precision!r}; the study link runs "
                          "'32-true' only so far")
        if not self.owners or len(set(self.owners)) != len(self.owners):
            raise Refused(f"{where}: owners = {list(self.owners)}; name each owner once")
        if not 1 <= self.quorum <= len(self.owners):
            raise Refused(f"{where}: quorum = {self.quorum} of {len(self.owners)} owners")
        if not isinstance(self.round_steps, int) or self.round_steps < 0:
            raise Refused(f"{where}: round_steps = {self.round_steps!r}; say how many "
                          "owner-steps a round is (0: a round is an epoch)")
        if self.averager is not None and (not isinstance(self.averager, str) or not self.averager
                                          or self.averager in self.owners or not self.parts):
            raise Refused(f"{where}: averager = {self.averager!r}; name the certificate of "
                          "a party that is not an owner, for a study that averages parts")
        if "class" not in self.optimizer:
            raise Refused(f"{where}: optimizer = {dict(self.optimizer)}; name its class: "
                          "{class = 'torch.optim.SGD', lr = 0.1}")

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> StudyConfig:
        """A study from a TOML file (tables ``[study]``, ``[server]``, ``[rounds]``,
        ``[fedavg]``, or flat) or a dict of the same."""
        if isinstance(source, Mapping):
            data = dict(source)
        else:
            import tomllib

            data = tomllib.loads(Path(source).read_text())
        flat: dict[str, Any] = {}
        for k, v in data.items():
            if k in ("study", "server", "rounds", "fedavg") and isinstance(v, Mapping):
                flat.update(v)
            else:
                flat[k] = v
        known = {f.name for f in dataclasses.fields(cls)}
        odd = sorted(set(flat) - known)
        if odd:
            raise Refused(f"study {flat.get('name')!r}: unknown entries {odd}; a study "
                          f"knows {sorted(known)}")
        flat["owners"] = tuple(flat.get("owners", ()))
        flat["parts"] = tuple(flat.get("parts", ()))
        return cls(**flat)

    def described(self) -> dict[str, Any]:
        """What defines the shared module and how it trains (what the digest covers)."""
        got = {"name": self.name, "module": self.module, "kwargs": dict(self.kwargs),
               "init": self.init, "optimizer": dict(self.optimizer),
               "schedule": self.schedule, "order": self.order, "parts": list(self.parts),
               "owners": sorted(self.owners)}
        if self.round_steps:  # (epoch rounds keep the digests they had)
            got["round_steps"] = self.round_steps
        if self.averager:  # (as may a study the hub averages)
            got["averager"] = self.averager
        return got

    def digest(self) -> str:
        """The study's digest: an owner with another one is refused when it attaches."""
        from blake3 import blake3

        return blake3(json.dumps(self.described(), sort_keys=True).encode()).hexdigest()[:32]

    @property
    def seed_key(self) -> str:
        return self.key or self.name

    def build_module(self) -> Any:
        """The shared module as the hub starts it: its class, built after
        ``torch.manual_seed`` of ``init``."""
        import torch

        path, _, attr = self.module.partition(":")
        try:
            cls = getattr(importlib.import_module(path), attr)
        except (ImportError, AttributeError) as e:
            raise Refused(f"study {self.name!r}: module {self.module!r} is not installed "
                          f"here ({e}); the shared module is the hub's own code") from None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(self.init[5:]))
            return cls(**dict(self.kwargs))

    def build_optimizer(self, params: Any) -> Any:
        """The shared module's optimizer (the study's, never an owner's)."""
        spec = dict(self.optimizer)
        path, _, attr = spec.pop("class").rpartition(".")
        cls = getattr(importlib.import_module(path), attr)
        return cls(params, **spec)
