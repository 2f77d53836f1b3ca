"""Saying things once on stderr (through logging), so a long run is not flooded."""

from __future__ import annotations

import logging

log = logging.getLogger("somatize")
_said: set = set()


def say_once(what, message: str) -> None:
    """Log ``message`` as a warning the first time ``what`` is seen in this process."""
    if what in _said:
        return
    _said.add(what)
    log.warning(message)


def forget() -> None:
    """Let everything be said again (for tests)."""
    _said.clear()
