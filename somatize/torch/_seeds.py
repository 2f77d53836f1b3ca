"""Seeds derived from a key and a step's coordinates (HMAC-SHA256), for randomness that
must be exact without any RNG state crossing between parties: the study hub's per
owner-step seeds and the placed route's ``Worker(rng="derived")`` both draw from them,
and so do their oracles.

    seed = derived_seed("my-key", "encoder", "train", 12, 12, 0)   # 63 bits
    with seeded(seed):
        y = dropout(x)         # draws from that seed; the caller's RNG state put back
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Iterator
from typing import Any

import torch


def derived_seed(key: str, *coordinates: Any) -> int:
    """The 63-bit seed of ``coordinates`` (joined by ``/``) under ``key``."""
    msg = "/".join(str(c) for c in coordinates).encode()
    mac = hmac.new(str(key).encode(), msg, hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "big") >> 1


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Run the block with torch's CPU generator (and ``device``'s, a GPU's) seeded by
    ``seed``, and put the caller's states back after it."""
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)
        yield
