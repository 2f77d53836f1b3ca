"""The store across processes: written by one and read by another, several writers at
once, a writer SIGKILLed at each step of a write, and gc beside a writer."""

import signal
import subprocess
import threading

import pytest
import torch
from scenario import scenario, start
from store_writer import value

import somatize.torch  # noqa: F401  (registers the tensor's codec)
from somatize._store_cli import main as store_cli
from somatize.store import Store

STEPS = [f"{what}:{step}" for what in ("blob", "name")
         for step in ("open", "partial", "written", "closed", "renamed")]


def writer(*args) -> subprocess.Popen:
    return start("store_writer.py", *args, text=False)


def finish(p: subprocess.Popen) -> int:
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    assert p.returncode in (0, -signal.SIGKILL), err.decode()
    return p.returncode


def test_a_store_written_by_one_process_is_read_by_another(tmp_path):
    assert finish(writer("put", tmp_path, "value/k", 7, 100_000)) == 0
    kept = Store(tmp_path).get("value/k")
    assert kept.value == value(7, 100_000) and kept.meta == {"seed": "7"}
    # and the other way round, tensors included
    t = torch.randn(300, 200)
    Store(tmp_path).put("artifact/emb/x", {"t": t})
    code = (f"import torch, somatize.torch; from somatize.store import Store; "
            f"t = Store({str(tmp_path)!r}).get('artifact/emb/x').value['t']; "
            f"torch.manual_seed(0); print(float(t.double().sum()))")
    out = scenario("-c", code, timeout=120)
    assert float(out.stdout) == float(t.double().sum())


def test_several_processes_writing_at_once_lose_nothing(tmp_path):
    procs = [writer("many", tmp_path, f"w{i}_", 30, 20_000) for i in range(4)]
    store = Store(tmp_path)
    seen = 0
    while any(p.poll() is None for p in procs):
        for k in store.get_many([f"value/shared{i}" for i in range(5)]):
            if k is not None:  # a reader sees the whole value or nothing, never half
                assert k.value == value(k.value["seed"], 20_000)
                seen += 1
    assert all(finish(p) == 0 for p in procs)
    for i in range(4):
        for j in range(30):
            assert store.get(f"value/w{i}_{j}").value == value(1000 + j, 20_000)
    for s in range(5):
        assert store.get(f"value/shared{s}").value == value(s, 20_000)
    assert len(list(store.names())) == 4 * 30 + 5
    assert len(list(store.blobs())) == 30 + 5  # the same bytes, kept once
    assert not list((tmp_path / "tmp").iterdir())
    assert store_cli(["verify", str(tmp_path)]) == 0


@pytest.mark.parametrize("step", STEPS)
def test_a_writer_killed_at_any_step_leaves_the_whole_entry_or_none(tmp_path, step):
    store = Store(tmp_path)
    store.put("value/before", value(1, 1000))  # what was there must survive
    assert finish(writer("put", tmp_path, "value/k", 2, 50_000, "--kill-at", step)) == (
        -signal.SIGKILL)
    kept = store.get("value/k")
    if step == "name:renamed":
        assert kept.value == value(2, 50_000)
    else:
        assert kept is None
    assert store.get("value/before").value == value(1, 1000)
    assert store_cli(["verify", str(tmp_path)]) == 0
    store.gc()
    assert not list((tmp_path / "tmp").iterdir())  # gc removes what the killed writer left
    assert len(list(store.blobs())) == len({e.blob for e in store.entries()})
    assert store.put("value/k", value(2, 50_000))  # and the store goes on
    assert store.get("value/k").value == value(2, 50_000)


def test_gc_beside_a_writer_that_wrote_a_blob_and_is_about_to_name_it(tmp_path):
    ready, go = tmp_path / "ready", tmp_path / "go"
    store = Store(tmp_path / "soma")
    store.put("value/other", value(9, 100))
    p = writer("put", store.path, "value/k", 3, 10_000, "--pause-at", "blob:renamed", ready, go)
    try:
        for _ in range(6000):
            if ready.exists() or p.poll() is not None:
                break
            threading.Event().wait(0.01)
        assert ready.exists(), "the writer never reached the pause"
        # the blob is on disk and no name points at it yet: gc must not take it
        gc = threading.Thread(target=store.gc)
        gc.start()
        gc.join(timeout=1.0)  # without the lock, gc would be done by now, blob gone
        go.touch()
        gc.join(timeout=60)
        assert not gc.is_alive()
    finally:
        go.touch()
        assert finish(p) == 0
    assert store.get("value/k").value == value(3, 10_000)
    assert store.get("value/other").value == value(9, 100)
    assert store_cli(["verify", str(store.path)]) == 0
