"""Fixtures the store and cache tests share (no torch here: some tests run without it).

    def test_damage(store, said): ...; assert "damaged" in said()
"""

import os

import hosts as _hosts
import pytest

from somatize._say import forget
from somatize.store import Store

hosts = pytest.fixture(_hosts.fixture, name="hosts")  # network namespaces (tests/hosts.py)

# the files that take longest (a minute or more of a core: long scenarios, module-wide
# fixtures), run first: the two test processes take files in collection order, so neither
# is left running a long file alone at the end (`--durations=0` says which these are)
FIRST = ["test_remote.py", "test_placed_optimizers.py", "test_dropin.py", "test_secret.py",
         "test_microbatches_remote.py", "test_hosts.py", "test_remote_reliability.py",
         "test_lightning_split.py", "test_main_job.py", "test_fed_study.py",
         "test_fed_hosts.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # the rest as they were


@pytest.fixture(scope="session", autouse=True)
def forked_workers():
    """Embedded workers, this process's and its scenarios', forked from one warm process
    (somatize.remote.fork_workers): each starts without importing torch again. Lightning
    too, which the modules of tests' placed classes import. SOMATIZE_TEST_FORKS=0: none."""
    if os.environ.get("SOMATIZE_TEST_FORKS", "1") == "0":
        yield None
        return
    from somatize.remote import fork_workers

    server = fork_workers(["lightning.pytorch"])
    yield server
    server.close()


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
