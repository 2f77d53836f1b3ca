"""somatize's lines reach a plain script's output, as Lightning's do: the ``somatize``
logger says INFO (as ``lightning.pytorch``'s does), and a handler of its own writes to
stderr only when nothing else would (no handler at the root: no ``logging.basicConfig``,
no Hydra), only in the process that drives the run (rank zero, not a worker). Configure
logging yourself and your handlers take each line, once;
``logging.getLogger("somatize").setLevel(logging.WARNING)`` quiets it.

    import somatize       # installs it; nothing to call
"""

from __future__ import annotations

import logging
import os
import sys

NAME = "somatize"


def rank_zero() -> bool:
    """Whether this process drives the run (not a torchrun rank >= 1, not a worker)."""
    return os.environ.get("RANK", "0") == "0" and not os.environ.get("SOMATIZE_SERVING")


class _Fallback(logging.StreamHandler):
    """stderr (as it is at each line), when the root logger has no handler."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers and rank_zero():
            super().emit(record)


def install() -> None:
    """Give the ``somatize`` logger its INFO level and fallback handler (once)."""
    log = logging.getLogger(NAME)
    if not rank_zero() or any(isinstance(h, _Fallback) for h in log.handlers):
        return  # a worker's lines are its own (its stderr, at WARNING)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.addHandler(_Fallback())
