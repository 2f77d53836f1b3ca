"""The seeds a study's shared module draws its randomness from: one per owner-step,
derived by the hub from the study's key, so that no owner's RNG state crosses the wire
and an oracle derives the same.

    with seeded(generator_seed("ct-2027", "hospital-a", round=0, step=3)):
        out = trunk(activations)      # dropout here draws from that seed
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Iterator

import torch


def generator_seed(study: str, owner: str, round: int, step: int) -> int:
    """The 63-bit seed of ``owner``'s step ``step`` of round ``round`` in ``study`` (the
    study's key: its name, or a secret the hub keeps)."""
    msg = f"{owner}/{int(round)}/{int(step)}".encode()
    mac = hmac.new(str(study).encode(), msg, hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "big") >> 1


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU generator seeded by ``seed``, and put the caller's
    state back after it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
