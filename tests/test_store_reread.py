"""A blob checked once in a process is not hashed again while its file is unchanged (its
stat identity: device, inode, size, mtime, ctime); a blob replaced or written into on disk
is hashed again, and is a miss or the right value, never another one."""

import gc
import os
import time

import pytest
import torch

import somatize.torch  # noqa: F401  (registers the tensor's codec)
from somatize.store import _recent, _store

pytestmark = pytest.mark.usefixtures("say_again")

BIG = 600_000  # floats: 2.4 MB, above the size that is mapped rather than read and held


@pytest.fixture
def hashed(monkeypatch):
    """The blobs the store hashes on reading, in order (its hash function, counted)."""
    seen = []

    def counted(data):
        seen.append(len(data))
        return digest(data)

    digest = _store.digest
    monkeypatch.setattr(_store, "digest", counted)
    return seen


@pytest.fixture
def settled(monkeypatch):
    """A file's times count as settled 50 ms after its last change (not 2 s): a test then
    waits 60 ms after writing, well past any ext4/xfs/tmpfs timestamp tick."""
    monkeypatch.setattr(_recent, "SETTLED_NS", 50_000_000)
    return lambda: time.sleep(0.06)


def _kept_big(store, name="value/v", seed=0):
    torch.manual_seed(seed)
    t = torch.randn(BIG)
    assert store.put(name, t)
    return t, store.blob_path(store.entry(name).blob)


def test_a_big_blob_read_twice_is_hashed_once(store, hashed, settled):
    t, _ = _kept_big(store)
    settled()
    for _ in range(3):
        assert torch.equal(store.get("value/v").value, t)
    assert len(hashed) == 1


def test_a_blob_read_just_after_it_was_written_is_hashed_again_until_it_settles(
        store, hashed, settled, monkeypatch):
    # its times may share a clock tick with a change still to come: they prove nothing yet
    monkeypatch.setattr(_recent, "SETTLED_NS", 60_000_000_000)  # a stalled test is still "just"
    t, _ = _kept_big(store)
    assert torch.equal(store.get("value/v").value, t)
    assert torch.equal(store.get("value/v").value, t)
    assert len(hashed) == 2
    monkeypatch.setattr(_recent, "SETTLED_NS", 50_000_000)
    settled()
    assert torch.equal(store.get("value/v").value, t)
    assert torch.equal(store.get("value/v").value, t)
    assert len(hashed) == 3


def _other_blob_bytes(store, path):
    """The bytes of another value's blob, of the same size: what a stale check would serve."""
    u, other = _kept_big(store, "value/u", seed=1)
    data = other.read_bytes()
    assert len(data) == path.stat().st_size and data != path.read_bytes()
    return u, data


def test_a_blob_replaced_by_another_file_is_hashed_again_and_a_miss(store, hashed, settled,
                                                                    said):
    t, path = _kept_big(store)
    u, data = _other_blob_bytes(store, path)
    settled()
    assert torch.equal(store.get("value/v").value, t)
    gc.collect()  # nothing of the old mapping is left to see the new file through
    fresh = path.with_suffix(".new")
    fresh.write_bytes(data)
    os.replace(fresh, path)  # same name, same size, a new inode
    got = store.get("value/v")
    assert got is None, "a blob replaced on disk was served without its check"
    assert "is damaged" in said()
    assert torch.equal(store.get("value/u").value, u)


def test_a_blob_written_into_in_place_with_its_mtime_restored_is_hashed_again(
        store, hashed, settled, said):
    t, path = _kept_big(store)
    u, data = _other_blob_bytes(store, path)
    settled()
    assert torch.equal(store.get("value/v").value, t)
    n = len(hashed)
    gc.collect()
    before = path.stat()
    with open(path, "r+b") as f:  # same inode, same size: only ctime says it changed
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    got = store.get("value/v")
    assert len(hashed) == n + 1
    assert got is None, "a blob written into on disk was served without its check"
    assert "is damaged" in said()


def test_a_blob_put_again_after_being_found_damaged_is_hashed_then_trusted(
        store, hashed, settled):
    t, path = _kept_big(store)
    settled()
    assert torch.equal(store.get("value/v").value, t)
    gc.collect()
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\0\0\0\0\0")
    assert store.get("value/v") is None  # moved aside
    assert store.put("value/v", t)
    settled()
    assert torch.equal(store.get("value/v").value, t)
    assert torch.equal(store.get("value/v").value, t)
    assert len(hashed) == 3
