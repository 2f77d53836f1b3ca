"""An owner's handle on a study: where the hub is, who this owner is (its certificate),
and the study's definition; ``study.shared`` names the shared module in ``place=``.

    study = Study("studies/ct-2027.toml", hub="hub.example.org:7443", owner="hospital-a",
                  identity="hospital-a.pem", ca="ca.pem")
    trainer = pl.Trainer(strategy=SomatizeStrategy(place={"trunk": study.shared}))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .._errors import Refused
from ._config import StudyConfig


@dataclasses.dataclass(frozen=True)
class Shared:
    """What ``place=`` names for a study's shared module: it runs on the study's hub."""

    study: Study

    @property
    def somatize_study(self) -> Study:
        return self.study


class Study:
    """One owner's part in a study.

    Args:
        config: the study's definition (a TOML file, a dict, or a ``StudyConfig``): the
            same one the hub serves (its digest is compared when the owner attaches).
        hub: ``host:port`` of the study's hub (this owner dials out to it).
        owner: this owner's name, the common name of its certificate.
        identity: this owner's ``.pem`` (its key and certificate, ``somatize fed cert``).
        ca: the study's CA certificate (the hub's is checked against it).
        hub_name: the name in the hub's certificate.
        timeout: seconds a call waits for the hub before the fit stops, naming it.
        averager: ``host:port`` of the study's averager, for a study that names one
            (``[fedavg] averager = NAME``, the common name of its certificate): the
            parts go there at each barrier, never to the hub.
    """

    def __init__(self, config: Any, hub: str, owner: str, identity: str | Path,
                 ca: str | Path, hub_name: str = "hub", timeout: float = 30.0,
                 averager: str | None = None):
        self.config = config if isinstance(config, StudyConfig) else StudyConfig.load(config)
        if owner not in self.config.owners:
            raise Refused(f"owner {owner!r} is not one of study {self.config.name!r}'s "
                          f"owners {list(self.config.owners)}")
        self.hub, self.owner, self.identity, self.ca = hub, owner, identity, ca
        self.hub_name, self.timeout, self.averager = hub_name, timeout, averager
        if self.config.averager and not averager:
            raise Refused(f"study {self.config.name!r} averages its parts at averager "
                          f"{self.config.averager!r}: give its address, Study(..., "
                          "averager='host:port')")

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def shared(self) -> Shared:
        """The shared module's place: ``SomatizeStrategy(place={"trunk": study.shared})``."""
        return Shared(self)

    def link(self) -> Any:
        """A new connection to the hub."""
        from ._link import HubLink

        return HubLink(self.hub, self.identity, self.ca, self.hub_name, self.timeout)

    def averager_link(self) -> Any:
        """A new connection to the study's averager (None when the hub averages)."""
        from ._link import HubLink

        if not self.config.averager:
            return None
        return HubLink(self.averager, self.identity, self.ca, self.config.averager,
                       self.timeout, role="study averager")

    def __repr__(self) -> str:
        return f"Study({self.name!r}, hub={self.hub!r}, owner={self.owner!r})"


def shared_place(path: str, config: Any, hub: str, owner: str, identity: str | Path,
                 ca: str | Path, hub_name: str = "hub", timeout: float = 30.0,
                 averager: str | None = None) -> dict[str, Shared]:
    """``{path: Study(...).shared}``: what ``place=`` takes, for a config system that
    cannot build the study first (``configs/somatize/splitfed.yaml``)."""
    return {path: Study(config, hub, owner, identity, ca, hub_name, timeout,
                        averager).shared}
