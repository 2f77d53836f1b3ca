"""The seeds a study's shared module draws its randomness from: one per owner-step,
derived by the hub from the study's key, so that no owner's RNG state crosses the wire
and an oracle derives the same.

    with seeded(generator_seed("ct-2027", "hospital-a", round=0, step=3)):
        out = trunk(activations)      # dropout here draws from that seed
"""

from __future__ import annotations

from ..torch._seeds import derived_seed, seeded

__all__ = ["generator_seed", "seeded"]


def generator_seed(study: str, owner: str, round: int, step: int) -> int:
    """The 63-bit seed of ``owner``'s step ``step`` of round ``round`` in ``study`` (the
    study's key: its name, or a secret the hub keeps)."""
    return derived_seed(study, owner, int(round), int(step))
