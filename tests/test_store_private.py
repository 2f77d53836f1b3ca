"""A store is private to its owner unless made shared, never follows a link below its
root, and takes only exact names (docs/security.md)."""

import os
import stat
import subprocess
import sys

import pytest
import torch

import somatize.torch  # noqa: F401  (registers the tensor's codec)
from somatize import StoreError
from somatize._store_cli import main as store_cli
from somatize.store import Store

pytestmark = pytest.mark.usefixtures("say_again")


def _modes(root):
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def test_a_store_is_private_to_its_owner_whatever_the_umask(tmp_path):
    old = os.umask(0o000)  # the widest umask: modes come from the store, not from it
    try:
        store = Store(tmp_path / "soma")
        assert store.put("value/a", torch.tensor([1.0]))
        assert store.put("artifact/emb/x", torch.tensor([2.0]))
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "soma")
    assert stat.S_IMODE(os.stat(tmp_path / "soma").st_mode) == 0o700
    dirs = {p: m for p, m in modes.items() if os.path.isdir(tmp_path / "soma" / p)}
    files = {p: m for p, m in modes.items() if p not in dirs}
    assert dirs and set(dirs.values()) == {0o700}, dirs
    assert files and set(files.values()) == {0o600}, files


def test_a_shared_store_gives_its_group_access_and_nobody_else(tmp_path):
    old = os.umask(0o022)  # the usual umask would take the group's write away
    try:
        store = Store(tmp_path / "soma", shared=True)
        assert store.put("value/a", torch.tensor([1.0]))
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "soma")
    for p, m in modes.items():
        want = 0o2770 if os.path.isdir(tmp_path / "soma" / p) else 0o660
        assert m == want, (p, oct(m))
    assert Store(tmp_path / "soma").get("value/a").value.item() == 1.0


def test_a_store_made_before_loses_what_others_could_read(tmp_path):
    root = tmp_path / "soma"
    for d in ("blobs", "names", "tmp"):
        (root / d).mkdir(parents=True, mode=0o755)
        os.chmod(root / d, 0o755)  # what stores were made with before
    Store(root).put("value/a", torch.tensor([1.0]))
    assert {stat.S_IMODE(os.stat(root / d).st_mode) for d in ("blobs", "names", "tmp")} \
        == {0o700}


@pytest.mark.parametrize("name", ["value/abc\n", "value/abc\nvalue/x", "artifact/k/\n",
                                  "value/../x", "value/a/b", "value/", "value/.x"])
def test_a_name_is_matched_whole(store, name):
    with pytest.raises(StoreError, match="not a store name"):
        store.put(name, torch.tensor([1.0]))
    with pytest.raises(StoreError, match="not a store name"):
        store.get(name)


def test_a_name_file_pointing_at_a_blob_with_a_newline_is_a_miss(store, said):
    assert store.put("value/a", torch.tensor([1.0]))
    f = store.name_path("value/a")
    f.write_text(f.read_text().replace('", "meta"', '\\n", "meta"'))
    assert store.get("value/a") is None
    assert "not a BLAKE3 hex hash" in said()


def _outside(tmp_path):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.safetensors").write_bytes(b"not the store's")
    return out


def test_gc_never_follows_a_symlinked_blob_directory_out_of_the_store(tmp_path, said):
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    out = _outside(tmp_path)
    # a name-less "blob" directory that is a link to a directory outside the store
    victim = out / ("ab" + "0" * 62 + ".safetensors")
    victim.write_bytes(b"precious")
    os.symlink(out, store.path / "blobs" / "ab")
    assert "ab" + "0" * 62 not in dict(store.blobs())
    store.gc()
    assert victim.read_bytes() == b"precious"
    assert (out / "keep.safetensors").read_bytes() == b"not the store's"
    assert "blobs/ab below it is a link" in said()
    assert store.get("value/a").value.item() == 1.0
    assert os.path.islink(store.path / "blobs" / "ab")  # left alone, not removed either


def test_gc_removes_a_link_in_tmp_but_never_what_it_points_at(tmp_path):
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    out = _outside(tmp_path)
    os.symlink(out / "keep.safetensors", store.path / "tmp" / "leftover")
    store.gc()
    assert (out / "keep.safetensors").read_bytes() == b"not the store's"


def test_a_put_never_writes_through_a_symlinked_names_directory(tmp_path, said):
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    out = _outside(tmp_path)
    os.symlink(out, store.path / "names" / "artifact")
    assert store.put("artifact/emb/x", torch.tensor([2.0])) is False
    assert sorted(os.listdir(out)) == ["keep.safetensors"]
    assert "names/artifact is a link" in said()
    assert store.get("artifact/emb/x") is None  # nor read through it


def test_a_put_replaces_a_linked_name_file_and_never_writes_its_target(tmp_path):
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    out = _outside(tmp_path)
    os.symlink(out / "keep.safetensors", store.path / "names" / "value" / "b")
    assert store.put("value/b", torch.tensor([2.0]))
    assert (out / "keep.safetensors").read_bytes() == b"not the store's"
    assert not os.path.islink(store.path / "names" / "value" / "b")
    assert store.get("value/b").value.item() == 2.0


def test_a_read_never_follows_a_linked_name_file_or_blob(tmp_path, said):
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    other = Store(tmp_path / "other")
    assert other.put("value/a", torch.tensor([5.0]))
    e = other.entry("value/a")
    # a name file that is a link to another store's name file: a miss
    os.symlink(other.name_path("value/a"), store.path / "names" / "value" / "c")
    assert store.get("value/c") is None
    # a blob directory that is a link into another store: a miss, nothing read through it
    os.rename(store.path / "names" / "value" / "c", store.path / "names" / "value" / "x")
    (store.path / "names" / "value" / "d").write_bytes(other.name_path("value/a").read_bytes())
    os.symlink(other.path / "blobs" / e.blob[:2], store.path / "blobs" / e.blob[:2])
    assert store.get("value/d") is None
    assert "is a link" in said()


def test_verify_says_a_linked_blob_is_damaged_and_reads_nothing_through_it(tmp_path, capsys):
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    e = store.entry("value/a")
    real = store.blob_path(e.blob)
    moved = tmp_path / "moved.safetensors"
    os.rename(real, moved)
    os.symlink(moved, real)
    assert store_cli(["verify", str(store.path)]) == 1
    assert "a link, which the store never follows" in capsys.readouterr().err


def test_the_root_itself_may_be_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "soma")
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    assert store.get("value/a").value.item() == 1.0
    assert store.gc() == (0, 0)
    assert list(store.names()) == ["value/a"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_read_a_private_store(tmp_path):
    os.chmod(tmp_path, 0o755)
    store = Store(tmp_path / "soma")
    assert store.put("value/a", torch.tensor([1.0]))
    blob = store.blob_path(store.entry("value/a").blob)
    code = ("import os, sys; os.setgid(65534); os.setuid(65534)\n"
            "for p in sys.argv[1:]:\n"
            "    try: open(p, 'rb').read(); print('read', p)\n"
            "    except PermissionError: print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code, str(blob),
                          str(store.name_path("value/a"))],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["refused", "refused"], out.stdout + out.stderr
