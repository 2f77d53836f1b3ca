"""Several data owners sharing one server part (SplitFed V1 and V2), exactly, across
organizations: each owner runs its own Lightning fit; a hub holds the shared module.

    study = Study("studies/ct-2027.toml", hub="hub:7443", owner="hospital-a",
                  identity="hospital-a.pem", ca="ca.pem")
    trainer = pl.Trainer(strategy=SomatizeStrategy(place={"trunk": study.shared}))

``docs/splitfed.md`` has the whole story: the hub, what crosses, the oracles.
"""

from ._average import average
from ._config import StudyConfig
from ._frames import FrameError
from ._link import Excluded, HubRefused
from ._replay import Run, replay, schedule, simulate
from ._rounds import export_round, load_round
from ._seeds import generator_seed
from ._study import Shared, Study, shared_place

__all__ = ["Excluded", "FrameError", "HubRefused", "Run", "Shared", "Study", "StudyConfig",
           "average", "export_round", "generator_seed", "load_round", "replay", "schedule",
           "shared_place", "simulate"]
