"""A config module a cached forward reads an attribute of (tests/test_cache_reads.py)."""

GAIN = 1.0
