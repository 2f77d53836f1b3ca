"""A config module a cached forward reads an attribute of (tests/test_cache_reads.py), and
a helper in it that reads its own module's global (tests/test_cache_reads_more.py)."""

GAIN = 1.0
SHIFT = 0.0


def shift(y):
    return y + SHIFT
