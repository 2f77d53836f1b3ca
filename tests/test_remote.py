"""Embedded workers: a stretch of the graph runs in a local worker process, over RPC.

Each test runs its coordinator, a function of tests/remote_graph_runs.py, in a process of its
own (RPC is initialised once per process).
"""

from __future__ import annotations

from remote_run import coordinate, no_worker_left


def test_the_seeds_graph_on_an_embedded_worker_equals_one_process(tmp_path):
    out = coordinate("seeds_graph", cwd=tmp_path)
    assert no_worker_left([out.split("PID")[1].split()[0]])


def test_the_coordinator_and_its_worker_listen_on_loopback_only(tmp_path):
    out = coordinate("loopback_only", cwd=tmp_path)
    lines = [line.split()[2:] for line in out.splitlines() if line.startswith("LISTENS")]
    assert len(lines) == 2 and all(lines), out  # both listen, the rendezvous among them
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    assert {a for addrs in lines for a in addrs} <= loopback, out
    (ifname,) = [line.split()[1:] for line in out.splitlines() if line.startswith("IFNAME")]
    assert all(name.startswith("lo") for name in ifname), out


def test_tensors_cross_as_tensors_every_dtype_and_bit_kept(tmp_path):
    coordinate("every_dtype", cwd=tmp_path)


def test_a_big_matrix_product_over_there_equals_here_with_the_default_threads(tmp_path):
    coordinate("big_matrix_product", cwd=tmp_path)


def test_a_worker_is_started_with_what_the_environment_says_before_our_defaults():
    from somatize.remote._settings import serving_env

    assert serving_env({})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert serving_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert serving_env({})["THP_MEM_ALLOC_ENABLE"] == "1"


def test_a_class_defined_in_the_script_travels_by_value(tmp_path):
    coordinate("by_value", cwd=tmp_path)


def test_an_opaque_read_only_over_there_does_not_stop_the_stretch(tmp_path):
    coordinate("opaque_over_there", cwd=tmp_path)


def test_an_outcome_leaves_behind_what_cannot_travel_and_keeps_what_it_answers_with(tmp_path):
    coordinate("left_behind", cwd=tmp_path)


def test_a_value_from_one_worker_to_another_travels_as_an_rref(tmp_path):
    coordinate("worker_to_worker", cwd=tmp_path)


def test_remote_stretches_of_one_wave_are_in_flight_together(tmp_path):
    # each node waits for the other's file: run one after the other, they would time out
    coordinate("one_wave", cwd=tmp_path)


def test_a_worker_that_keeps_does_not_run_again_what_it_kept(tmp_path):
    # CU13: no store here, one there; the names of what ran over there come back
    coordinate("kept_over_there", tmp_path / "there", cwd=tmp_path, timeout=120)


def test_the_name_a_worker_is_brought_and_the_name_it_gives_back_are_one_processs(tmp_path):
    # CU13: the key of what feeds a stretch crosses with it; the key of what it ran comes
    # back; both are the names one process computes, and the worker keeps under them
    coordinate("names_of_one_process", tmp_path / "there", cwd=tmp_path)


def test_provisioning_refuses_a_different_catalog_on_an_open_session(tmp_path):
    coordinate("another_catalog", cwd=tmp_path)


def test_an_exception_in_a_node_over_there_is_its_own_type_naming_the_worker_and_node(
        tmp_path):
    coordinate("boom_over_there", cwd=tmp_path)


def test_a_call_that_takes_too_long_fails_within_the_timeout(tmp_path):
    coordinate("too_long", cwd=tmp_path)


def test_two_graphs_in_one_process_share_a_worker_each_with_its_own_catalog(tmp_path):
    out = coordinate("two_graphs", cwd=tmp_path)
    assert no_worker_left([out.split("PID")[1].split()[0]])


def test_a_normal_close_says_nothing_on_stderr(tmp_path):
    # TensorPipe warns about any pipe closing under an agent that has not left the group
    # ("encountered error when reading incoming request from gpu: EOF"): the close's order
    # must leave none. Trained and closed; two workers passing an RRef, closed together;
    # a group started again after the last worker left; one left open until exit.
    from scenario import scenario

    r = scenario("remote_graph_runs.py", "quiet_close", timeout=120, cwd=tmp_path)
    assert r.stdout.strip() == "done", r.stderr[-4000:]
    assert r.stderr == "", r.stderr[-4000:]
