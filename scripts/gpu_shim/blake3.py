"""A stand-in for the ``blake3`` package, for ``scripts/gpu_check.sh`` alone, on a machine
that has no blake3 and no registry to get it from: the same calls, over hashlib's BLAKE2b.
Names hashed with it are not blake3's: a store written under it is for that run only.
Never on the path otherwise (gpu_check.sh adds it only when ``import blake3`` fails)."""

import hashlib


class blake3:  # noqa: N801 (the package's own spelling)
    AUTO = -1

    def __init__(self, data=b"", *, key=None, max_threads=1):
        self._h = hashlib.blake2b(digest_size=64, key=bytes(key) if key is not None else b"")
        if data:
            self._h.update(data)

    def update(self, data):
        self._h.update(data)
        return self

    def digest(self, length=32):
        return self._h.digest()[:length]

    def hexdigest(self, length=32):
        return self.digest(length).hex()
