"""Fixtures the store and cache tests share (no torch here: some tests run without it).

    def test_damage(store, said): ...; assert "damaged" in said()
"""

import os
import sys

import hosts as _hosts
import pytest

from somatize._say import forget
from somatize.store import Store

hosts = pytest.fixture(_hosts.fixture, name="hosts")  # network namespaces (tests/hosts.py)

# the files that take longest (a minute or more of a core: long scenarios, module-wide
# fixtures), run first: the two test processes take files in collection order, so neither
# is left running a long file alone at the end (`--durations=0` says which these are)
FIRST = ["test_remote.py", "test_placed_optimizers.py", "test_dropin.py", "test_gpu_check.py",
         "test_secret.py", "test_fed_study.py", "test_hosts.py", "test_placed_edges.py",
         "test_placed_hf.py",
         "test_docs.py", "test_microbatches_remote.py", "test_remote_reliability.py",
         "test_lightning_split.py", "test_main_job.py", "test_fed_hosts.py", "test_hydra.py"]


# the files whose tests start processes (workers, scenarios, scripts, torchrun); the
# rest run in-process: `bash scripts/test.sh -m "not processes"` is the fast loop. A test
# outside these files that starts one fails (pytest_runtest_makereport), naming this list.
PROCESSES = {
    "test_cache.py", "test_cache_faithful.py", "test_cache_rows.py", "test_describe.py",
    "test_docs.py",
    "test_dropin.py",
    "test_dropin_cache.py", "test_faults.py", "test_fed_hosts.py", "test_fed_study.py",
    "test_fork_here.py", "test_forks.py", "test_gpu_check.py", "test_graph_optimizers.py",
    "test_hosts.py", "test_hosts_exposure.py",
    "test_hydra.py", "test_items_processes.py", "test_lightning.py",
    "test_lightning_split.py", "test_main_job.py", "test_microbatches_remote.py",
    "test_mixed_routes.py", "test_packaging.py", "test_per_item.py",
    "test_placed_edges.py", "test_placed_hf.py", "test_placed_optimizers.py",
    "test_placed_ordinary.py",
    "test_readme.py", "test_shm.py",
    "test_refusals.py", "test_remote.py", "test_remote_failure.py",
    "test_remote_reliability.py", "test_remote_standing.py", "test_remote_torchrun.py",
    "test_scenario.py", "test_secret.py", "test_stages.py", "test_store.py",
    "test_store_private.py", "test_store_processes.py", "test_strategy_input.py",
    "test_torch_node.py",
    "test_torchrun.py", "test_trace.py", "test_trainer_remote.py", "test_transport.py",
}
_started = [0]  # processes this process has started, by the audit events that say so


def _count_starts(event, args):
    if event in ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec",
                 "os.spawn"):
        _started[0] += 1


sys.addaudithook(_count_starts)


def pytest_configure(config):
    config.addinivalue_line("markers", "processes: starts worker or script processes "
                            "(the fast loop is -m 'not processes')")
    from somatize.store import _rows

    _rows.native()  # built (a compiler process) before any test: no test is seen starting it


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # the rest as they were
    for item in items:
        if item.path.name in PROCESSES:
            item.add_marker(pytest.mark.processes)


def _count_spawns() -> None:
    # an embedded worker forked by the warm server is no child of ours: count its start
    from somatize.remote import _group

    spawn = _group.spawn

    def counted(*args, **kwargs):
        _started[0] += 1
        return spawn(*args, **kwargs)

    _group.spawn = counted


_count_spawns()


_before: dict[str, int] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _before[item.nodeid] = _started[0]  # before its fixtures too: a module-wide one counts
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test outside ``PROCESSES`` that started a process or a worker (in its fixtures,
    its body or its teardown) fails, naming the list: the fast loop stays in-process."""
    report = yield
    if call.when != "teardown" or _started[0] == _before.pop(item.nodeid, _started[0]):
        return report
    record = os.environ.get("SOMATIZE_TEST_RECORD_STARTS")  # to list the files afresh
    if record:
        with open(record, "a") as f:
            f.write(item.path.name + "\n")
    elif item.get_closest_marker("processes") is None and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started a process or a worker, but its file is not "
                           "in PROCESSES (tests/conftest.py): add it there")
    return report


@pytest.fixture(scope="session", autouse=True)
def forked_workers(request):
    """Embedded workers, this process's and its scenarios', forked from one warm process
    (somatize.remote.fork_workers): each starts without importing torch again. Lightning
    too, which the modules of tests' placed classes import. SOMATIZE_TEST_FORKS=0: none."""
    if os.environ.get("SOMATIZE_TEST_FORKS", "1") == "0" or not any(
            item.get_closest_marker("processes") for item in request.session.items) and \
            not os.environ.get("SOMATIZE_TEST_RECORD_STARTS"):
        yield None  # none asked for, or nothing here starts workers (the fast loop)
        return
    from somatize.remote import fork_workers

    started = _started[0]
    server = fork_workers(["lightning.pytorch"])
    _started[0] = started  # the suite's own warm process, no test's
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
