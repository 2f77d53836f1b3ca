"""The strategy's launcher: rank 0 trains; under torchrun every other rank serves as a
worker (``serve_if_worker``) and exits 0 when the coordinator is done.

    strategy._configure_launcher()   # installs _ServingLauncher(strategy)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..remote import serve_if_worker
from ._private import launcher_base


class _ServingLauncher(launcher_base()):
    """Rank 0 trains; under torchrun, every other rank serves as a worker and exits 0."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        serve_if_worker()  # ranks >= 1 serve here until rank 0 is done, then exit 0
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        self.strategy._killed()  # a signal: no worker is waited for
