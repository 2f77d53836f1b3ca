"""Fixtures the store and cache tests share (no torch here: some tests run without it).

    def test_damage(store, said): ...; assert "damaged" in said()
"""

import hosts as _hosts
import pytest

from somatize._say import forget
from somatize.store import Store

hosts = pytest.fixture(_hosts.fixture, name="hosts")  # network namespaces (tests/hosts.py)


@pytest.fixture
def say_again():
    """What is said once per process is said again in this test (and after it)."""
    forget()
    yield
    forget()


@pytest.fixture
def store(tmp_path):
    """A fresh directory store under the test's tmp_path."""
    return Store(tmp_path / "soma")


@pytest.fixture
def said(caplog):
    """A call answering everything logged so far in this test, one message a line."""
    return lambda: "\n".join(r.getMessage() for r in caplog.records)
