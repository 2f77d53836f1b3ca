"""Every private torch name somatize relies on, in one place, where torch offers no public
way. A torch upgrade that drops one breaks here; tests/test_private.py pins each.

    v = version(t)      # t's version counter: every in-place write bumps it
"""

from __future__ import annotations

import torch


def version(t: torch.Tensor) -> int:
    """``t``'s version counter, which every in-place write bumps (torch has no public way
    to read it): how writes here are seen without comparing values."""
    return t._version
