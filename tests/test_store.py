"""The directory store: names, blobs, packing, damage, failures, and ``somatize store``."""

import json
import struct
import subprocess
import sys

import pytest
import torch
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from scenario import scenario

import somatize.torch  # noqa: F401  (registers the tensor's codec)
from somatize import Keeper, Kept, StoreError, codec
from somatize._packing import _encode, pack, unpack
from somatize._store_cli import main as store_cli
from somatize._values import Blob
from somatize.store import Guarded, Store, open_keeper

pytestmark = pytest.mark.usefixtures("say_again")


def test_the_store_and_its_command_import_no_torch():
    code = ("import sys, somatize.store, somatize._store_cli, somatize._packing; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    scenario("-c", code, timeout=60)


# -- the questionnaire's store section --

def test_a_batch_answers_in_the_order_it_was_asked_holes_included(store):
    store.put("value/a", torch.tensor([1.0]))
    store.put("value/c", torch.tensor([3.0]))
    got = store.get_many(["value/c", "value/b", "value/a", "value/zz"])
    assert [None if k is None else k.value.item() for k in got] == [3.0, None, 1.0, None]


def test_a_name_nobody_kept_is_a_miss_and_not_a_failure(tmp_path, said):
    assert Store(tmp_path / "never-created").get("value/abc") is None
    assert Store(tmp_path / "never-created").get_many(["value/abc"]) == [None]
    assert "never-created" not in said()
    assert not (tmp_path / "never-created").exists()  # reading creates nothing


def test_a_kept_value_is_findable_by_looking_at_what_is_in_the_store(store):
    store.put("value/k1", {"emb": torch.ones(2)}, meta={"node": "encoder"})
    store.put("artifact/weights/abc", torch.zeros(3))
    assert sorted(store.names()) == ["artifact/weights/abc", "value/k1"]
    assert list(store.names("value/")) == ["value/k1"]
    (entry,) = store.entries("value/")
    assert entry.meta == {"node": "encoder"}


def test_the_same_bytes_under_two_names_are_stored_once(store):
    t = torch.randn(100, 10)
    store.put("value/one", t, meta={"node": "a"})
    store.put("value/two", t.clone(), meta={"node": "b"})  # other meta: meta is beside the bytes
    store.put("artifact/emb/x", t)
    assert len(list(store.blobs())) == 1
    assert len({e.blob for e in store.entries()}) == 1
    assert store.get("value/two").meta == {"node": "b"}


def test_a_blob_is_never_rewritten_in_place_while_a_reader_holds_it_mapped(store):
    import mmap

    t = torch.randn(256, 64)
    store.put("value/v", t)
    path = store.blob_path(store.entry("value/v").blob)
    before = path.stat()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        held = bytes(mapped)
        store.put("value/v", t.clone())  # the same bytes again, under the same name
        store.put("value/w", t.clone())  # and under another
        store.put("value/v", t + 1)  # the name now points elsewhere: a new blob
        after = path.stat()
        assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
            before.st_ino, before.st_mtime_ns, before.st_size)
        assert bytes(mapped) == held  # a truncation here would have been SIGBUS
    assert store.entry("value/v").blob != store.entry("value/w").blob
    assert torch.equal(store.get("value/w").value, t)
    assert torch.equal(store.get("value/v").value, t + 1)


# -- packing: one safetensors file, written by hand, never unpickled --

def test_a_nested_value_comes_back_as_it_was(store):
    value = {
        "emb": torch.randn(3, 4),
        "ids": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(7, dtype=torch.float16),  # odd sizes: alignment must hold
        "mask": torch.tensor([True, False, True]),
        "bf": torch.randn(3, dtype=torch.bfloat16),
        "nested": [1, 2.5, None, "text", (True, b"\x00\x01raw"), {"deep": [torch.ones(1)]}],
        7: "an int key", (1, "a"): "a tuple key",
        "big": 2**80, "inf": float("inf"), "empty": torch.empty(0, 3),
    }
    assert store.put("value/v", value)
    back = store.get("value/v").value
    assert back.keys() == value.keys()
    for k, v in value.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert back["nested"][:5] == value["nested"][:5]
    assert torch.equal(back["nested"][5]["deep"][0], torch.ones(1))
    assert back["big"] == 2**80 and back["inf"] == float("inf")


scalars = st.none() | st.booleans() | st.integers() | st.text() | st.binary() | st.floats(
    allow_nan=False)
values = st.recursive(scalars, lambda inner: (
    st.lists(inner) | st.tuples(inner, inner) | st.dictionaries(st.text() | st.integers(), inner)
), max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(values)
def test_any_nested_value_packs_and_unpacks_to_itself(value):
    header, buffers = pack(value)
    assert unpack(memoryview(header + b"".join(buffers))) == value


def test_a_blob_is_a_safetensors_file_that_safetensors_reads(store):
    t = {"a": torch.randn(4, 4), "b": torch.arange(3, dtype=torch.int16)}
    store.put("value/v", t)
    (blob, _), = store.blobs()
    loaded = load_file(str(store.blob_path(blob)))
    assert sorted(torch.cat([v.flatten().double() for v in loaded.values()]).tolist()) == sorted(
        torch.cat([v.flatten().double() for v in t.values()]).tolist())
    raw = store.blob_path(blob).read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert "somatize/1" in header["__metadata__"]  # the structure travels in the metadata
    assert b"pickle" not in raw and not raw.startswith(b"\x80")


def test_a_restored_tensor_is_a_leaf_on_the_cpu_and_safe_to_modify(store):
    w = torch.randn(512, 1024, requires_grad=True)
    y = (w * 2).relu()  # has autograd history
    store.put("value/y", y)
    back = store.get("value/y").value
    # what comes back from a store has no history: a backward pass stops here
    assert back.is_leaf and back.grad_fn is None and not back.requires_grad
    assert back.device.type == "cpu"
    assert torch.equal(back, y.detach())
    back.add_(1)  # a private copy: the kept value does not change
    assert torch.equal(store.get("value/y").value, y.detach())
    assert store.check_blob(next(store.blobs())[0]) is None


def test_a_value_whose_type_has_no_codec_is_not_kept_and_stderr_says_why_once(store, said):
    class Handle:
        pass

    assert store.put("value/h", {"x": Handle()}) is False
    assert store.put("value/h2", [Handle()]) is False
    assert said().count("Handle has no codec") == 1
    assert list(store.names()) == []


def test_a_registered_codec_makes_a_type_keepable(store):
    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

    codec("point", Point,
          dump=lambda p: Blob("F64", (2,), memoryview(bytearray(
              torch.tensor([p.x, p.y], dtype=torch.float64).numpy().tobytes()))),
          load=lambda b: Point(*torch.frombuffer(bytearray(b.data), dtype=torch.float64).tolist()))
    try:
        assert store.put("value/p", {"p": Point(1.5, -2.0)})
        p = store.get("value/p").value["p"]
        assert (type(p), p.x, p.y) == (Point, 1.5, -2.0)
    finally:
        from somatize._values import _codecs

        _codecs.pop("point")


def test_a_store_name_is_value_key_or_artifact_kind_id(store):
    for bad in ["value", "value/../x", "other/k", "artifact/k", "value/a/b", "value/.hidden"]:
        with pytest.raises(StoreError, match="not a store name"):
            store.put(bad, 1)


# -- damage and failures never give a wrong value nor kill the run --

def _corrupt(path, at=-5):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))  # by hand, in place: what a store itself never does


def test_a_corrupted_blob_is_detected_on_read_treated_as_a_miss_and_said(store, said):
    t = torch.randn(64, 64)
    store.put("value/v", t)
    (blob, _), = store.blobs()
    _corrupt(store.blob_path(blob))
    assert store.get("value/v") is None
    assert "is damaged" in said() and blob[:16] in said()
    # moved aside: keeping the value again rewrites it, and it reads back whole
    assert store.put("value/v", t)
    assert torch.equal(store.get("value/v").value, t)


def test_a_blob_damaged_after_it_was_read_is_still_served_whole_then_verify_finds_it(store):
    t = torch.randn(64, 64)
    store.put("value/v", t)
    assert torch.equal(store.get("value/v").value, t)
    _corrupt(store.blob_path(next(store.blobs())[0]))
    assert torch.equal(store.get("value/v").value, t)  # what was checked is held in memory
    assert store_cli(["verify", str(store.path)]) == 1


def test_a_truncated_blob_is_detected_on_read(store, said):
    store.put("value/v", torch.randn(1000))
    (blob, size), = store.blobs()
    with open(store.blob_path(blob), "r+b") as f:
        f.truncate(size // 2)
    assert store.get("value/v") is None
    assert "truncated" in said()


def test_a_big_corrupted_blob_is_detected_too(store):
    store.put("value/v", torch.randn(600_000))  # above the size that is memory-mapped
    (blob, _), = store.blobs()
    _corrupt(store.blob_path(blob), at=2_000_000)
    assert store.get("value/v") is None


def test_a_write_that_fails_after_its_blob_says_so_once_and_leaves_no_half_entry(store, said):
    # names/value is a regular file, so naming fails once the blob is written: a failure
    # that happens as root too (CI's user, whom permissions do not stop)
    store.put("artifact/emb/a", torch.ones(2))
    (store.path / "names" / "value").write_text("in the way")
    assert store.put("value/a", torch.ones(3)) is False
    assert store.put("value/b", torch.ones(4)) is False
    assert said().count("cannot keep") == 1
    assert store.get("value/a") is None  # a miss, not a failure
    assert torch.equal(store.get("artifact/emb/a").value, torch.ones(2))  # what was kept stays
    assert list((store.path / "tmp").iterdir()) == []  # no temporary file left behind
    unnamed = sum(size for _, size in store.blobs()) - store.entry("artifact/emb/a").size
    assert store.gc() == (2, unnamed)  # the two blobs nobody could name, and nothing else
    assert torch.equal(store.get("artifact/emb/a").value, torch.ones(2))


def test_a_store_on_a_bad_path_does_not_raise(tmp_path, said):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    store = Store(a_file)
    assert store.put("value/a", torch.ones(2)) is False
    assert store.put("value/b", torch.ones(2)) is False
    assert store.get("value/a") is None
    assert said().count("cannot keep") == 1


class Exploding:
    """A keeper that fails at everything."""

    def get_many(self, names):
        raise OSError(28, "No space left on device")

    def put(self, name, value, meta=None):
        raise OSError(28, "No space left on device")

    def names(self, prefix=""):
        raise RuntimeError("boom")


def test_a_keeper_that_raises_is_a_miss_and_not_kept_said_once(said):
    k = open_keeper(Exploding())
    assert k.get_many(["value/a", "value/b"]) == [None, None]
    assert k.get_many(["value/a"]) == [None]
    assert k.put("value/a", 1) is False and k.put("value/a", 1) is False
    assert list(k.names()) == []
    text = said()
    assert text.count("get_many failed") == 1 and text.count("put failed") == 1


def test_a_keeper_that_answers_the_wrong_number_of_results_is_a_miss():
    class Short:
        def get_many(self, names):
            return [Kept(1, {})]

        def put(self, name, value, meta=None):
            return True

    assert open_keeper(Short()).get_many(["value/a", "value/b"]) == [None, None]


def test_open_keeper_takes_none_a_path_or_a_keeper(tmp_path):
    assert open_keeper(None) is None
    assert isinstance(open_keeper(str(tmp_path)).keeper, Store)
    assert isinstance(open_keeper(tmp_path).keeper, Store)
    mine = Exploding()
    assert open_keeper(mine).keeper is mine
    assert isinstance(Store(tmp_path), Keeper)
    assert isinstance(open_keeper(tmp_path), Guarded)
    with pytest.raises(StoreError, match="store= takes a directory path or a Keeper"):
        open_keeper(42)


# -- somatize store ls / du / verify / gc --

def test_store_ls_shows_names_nodes_and_sizes(store, capsys):
    store.put("value/k1", torch.ones(10), meta={"node": "encoder", "class": "Encoder",
                                              "fingerprint": "{}"})
    assert store_cli(["ls", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert "value/k1" in out and "encoder" in out and "Encoder" in out


def test_store_du_counts_blobs_and_names(store, capsys):
    store.put("value/k1", torch.ones(10))
    store.put("value/k2", torch.ones(10))
    assert store_cli(["du", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert "1 blobs" in out and "2 names" in out


def test_store_verify_exits_non_zero_on_a_blob_corrupted_by_hand(store, capsys):
    store.put("value/k1", torch.randn(100))
    store.put("value/k2", torch.randn(100))
    assert store_cli(["verify", str(store.path)]) == 0
    blob = store.entry("value/k2").blob
    _corrupt(store.blob_path(blob))
    assert store_cli(["verify", str(store.path)]) == 1
    out = capsys.readouterr()
    assert blob[:16] in out.out + out.err and "value/k2" in out.out + out.err


def test_python_m_somatize_store_verify_runs_as_a_command(store):
    store.put("value/k1", torch.randn(10))
    ok = subprocess.run([sys.executable, "-m", "somatize", "store", "verify", str(store.path)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    _corrupt(store.blob_path(store.entry("value/k1").blob))
    bad = subprocess.run([sys.executable, "-m", "somatize", "store", "verify", str(store.path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1


def test_store_gc_removes_unreferenced_blobs_only(store, capsys):
    store.put("value/keep", torch.ones(10))
    store.put("value/drop", torch.zeros(10))
    # a name overwritten leaves its old blob unreferenced
    store.put("value/drop", torch.full((10,), 2.0))
    (store.path / "tmp" / "123-leftover").write_bytes(b"half a blob")
    assert len(list(store.blobs())) == 3
    assert store_cli(["gc", str(store.path)]) == 0
    assert len(list(store.blobs())) == 2
    assert not list((store.path / "tmp").iterdir())
    assert torch.equal(store.get("value/keep").value, torch.ones(10))
    assert torch.equal(store.get("value/drop").value, torch.full((10,), 2.0))
    assert store_cli(["verify", str(store.path)]) == 0


def test_store_commands_on_a_path_that_is_no_store_say_so(tmp_path, capsys):
    assert store_cli(["ls", str(tmp_path / "nothing")]) == 2
    assert "no store" in capsys.readouterr().err


# -- every tensor read back starts 64-byte aligned (an unaligned one changes numbers) --

def old_layout(value) -> bytes:
    """``value`` as the store packed it before tensors were 64-byte aligned: the header
    padded to 8 bytes, then the tensors back to back, widest dtype first."""
    blobs = []
    structure = _encode(value, blobs, 0)
    width = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
             "BF16": 2, "I16": 2, "U16": 2}
    header = {"__metadata__": {"somatize/1": json.dumps(structure)}}
    data = b""
    for i in sorted(range(len(blobs)), key=lambda i: -width.get(blobs[i].dtype, 1)):
        raw = bytes(memoryview(blobs[i].data).cast("B"))
        header[str(i)] = {"dtype": blobs[i].dtype, "shape": list(blobs[i].shape),
                          "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def put_raw(store: Store, name: str, raw: bytes, size: int | None = None) -> str:
    """Keep ``raw`` as a blob named by its hash, and ``name`` pointing at it, by hand."""
    blob = blake3(raw).hexdigest()
    store.blob_path(blob).parent.mkdir(parents=True, exist_ok=True)
    store.blob_path(blob).write_bytes(raw)
    store.name_path(name).parent.mkdir(parents=True, exist_ok=True)
    store.name_path(name).write_text(json.dumps(
        {"blob": blob, "size": len(raw) if size is None else size, "meta": {}}))
    return blob


def tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


MIXED = {"f32": torch.randn(3, 37), "f64": torch.randn(5, dtype=torch.float64),
         "i16": torch.arange(11, dtype=torch.int16), "half": torch.randn(13, dtype=torch.float16),
         "mask": torch.tensor([True, False, True]), "bf": torch.randn(7, dtype=torch.bfloat16),
         "ids": [torch.arange(9, dtype=torch.int64), torch.randn(1, 5)], "raw": b"\x01\x02"}
BIG = {"a": torch.randn(3, 37), "big": torch.randn(300_001), "c": torch.randn(5, 7)}  # > 1 MB


@pytest.mark.parametrize("value", [MIXED, BIG, torch.randn(7, 37)], ids=["mixed", "big", "one"])
def test_every_tensor_read_back_starts_64_byte_aligned_read_held_or_mapped(store, value):
    store.put("value/v", value)
    for _ in range(2):  # read from the file, then (when small) from what is held in memory
        back = store.get("value/v").value
        for t, want in zip(tensors_in(back), tensors_in(value), strict=True):
            assert torch.equal(t, want)
            assert t.data_ptr() % 64 == 0


@pytest.mark.parametrize("value", [MIXED, BIG], ids=["small", "big"])
def test_a_blob_written_before_tensors_were_aligned_still_reads_and_aligned(store, value):
    raw = old_layout(value)
    n = int.from_bytes(raw[:8], "little")
    starts = [8 + n + t["data_offsets"][0] for k, t in json.loads(raw[8:8 + n]).items()
              if k != "__metadata__"]
    assert any(s % 64 for s in starts)  # the old layout left tensors unaligned in the file
    put_raw(store, "value/old", raw)
    for _ in range(2):
        back = store.get("value/old").value
        for t, want in zip(tensors_in(back), tensors_in(value), strict=True):
            assert torch.equal(t, want) and t.data_ptr() % 64 == 0
    assert store_cli(["verify", str(store.path)]) == 0


# -- a blob crafted to hash right is damaged, never read --

def crafted(header: dict, structure, data: bytes = b"") -> bytes:
    header = {"__metadata__": {"somatize/1": json.dumps(structure)}, **header}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def nested(depth):
    s = None
    for _ in range(depth):
        s = {"l": [s]}
    return s


CLAIMS_4096_FLOATS = crafted(
    {"t": {"dtype": "F32", "shape": [4096], "data_offsets": [0, 0]}}, {"o": "tensor", "at": "t"})


def test_a_blob_that_hashes_right_but_claims_bytes_it_lacks_is_a_miss_moved_and_counted(
        store, said, capsys):
    blob = put_raw(store, "value/crafted", CLAIMS_4096_FLOATS)
    store.put("value/fine", torch.ones(3))
    assert store_cli(["verify", str(store.path)]) == 1
    out = capsys.readouterr()
    assert "1 damaged" in out.out and blob[:16] in out.err and "value/crafted" in out.err
    assert store.get("value/crafted") is None  # never 4096 floats of someone else's memory
    assert "is damaged" in said() and "16384 bytes" in said()
    assert not store.blob_path(blob).exists()
    assert (store.path / "damaged" / f"{blob}.safetensors").exists()
    assert torch.equal(store.get("value/fine").value, torch.ones(3))


def test_verify_goes_on_past_blobs_that_would_crash_the_reader_and_counts_them(store, capsys):
    deeper = b'{"__metadata__":{"somatize/1":"' + b"[" * 100_000 + b'"}}'
    bad = {"value/nested-200": crafted({}, nested(200)),  # RecursionError before
           "value/nested-100000": struct.pack("<Q", len(deeper)) + deeper,
           "value/empty-tag": crafted({}, {}),  # StopIteration before
           "value/unknown-tag": crafted({}, {"z": 1}),
           "value/claims": CLAIMS_4096_FLOATS}
    blobs = {name: put_raw(store, name, raw) for name, raw in bad.items()}
    store.put("value/zz-fine", torch.ones(3))  # checked after them all
    assert store_cli(["verify", str(store.path)]) == 1
    out = capsys.readouterr()
    assert f"{len(bad)} damaged" in out.out
    for name, blob in blobs.items():
        assert blob[:16] in out.err and name in out.err
    for name in bad:
        assert store.get(name) is None
    assert torch.equal(store.get("value/zz-fine").value, torch.ones(3))


# -- a damaged name file is a miss for that name, and touches nothing else --

def _rewrite_name(store, name, **fields):
    record = json.loads(store.name_path(name).read_text())
    record.update(fields)
    store.name_path(name).write_text(json.dumps(record))


BAD_NAMES = {
    "meta is a list": {"meta": ["node", "encoder"]},
    "meta holds an int": {"meta": {"node": 3}},
    "size is a string": {"size": "12"},
    "size is too big": {"size": 10**6},
    "size is too small": {"size": 9},
    "size is a float": {"size": 12.5},
    "blob is not a hash": {"blob": "../../etc/passwd"},
    "blob is a number": {"blob": 7},
}


@pytest.mark.parametrize("why", sorted(BAD_NAMES))
def test_a_damaged_name_file_is_a_miss_said_once_and_its_shared_blob_stays(
        store, said, capsys, why):
    store.put("value/shared", torch.ones(3), meta={"node": "a"})
    store.put("value/bad", torch.ones(3), meta={"node": "b"})  # the same bytes: one blob
    (blob, _), = store.blobs()
    store.get("value/shared")  # held in memory too: the size check must hold there as well
    _rewrite_name(store, "value/bad", **BAD_NAMES[why])
    assert store.get("value/bad") is None and store.get("value/bad") is None
    assert said().count(str(store.name_path("value/bad"))) == 1
    assert "damaged" not in {p.name for p in store.path.iterdir()}  # nothing moved aside
    assert store.blob_path(blob).exists()
    assert torch.equal(store.get("value/shared").value, torch.ones(3))
    assert store_cli(["ls", str(store.path)]) == 0
    assert "value/shared" in capsys.readouterr().out
    assert store_cli(["verify", str(store.path)]) == 1
    out = capsys.readouterr()
    assert "1 damaged" in out.out and str(store.name_path("value/bad")) in out.err
    assert store.put("value/bad", torch.ones(3))  # keeping it again writes the name whole
    assert torch.equal(store.get("value/bad").value, torch.ones(3))


@pytest.mark.parametrize("text", ["[1, 2]", "not json", '"a string"', "[" * 100_000])
def test_a_name_file_that_is_no_json_object_is_a_miss_and_ls_lists_the_rest(
        store, said, capsys, text):
    store.put("value/good", torch.ones(2))
    store.put("value/bad", torch.ones(3))
    store.name_path("value/bad").write_text(text)
    assert store.get("value/bad") is None
    assert [e.name for e in store.entries()] == ["value/good"]
    assert store_cli(["ls", str(store.path)]) == 0
    assert store_cli(["verify", str(store.path)]) == 1


def test_a_size_mismatch_on_a_blob_that_hashes_right_is_the_names_fault(store, said):
    store.put("value/v", torch.randn(1000))
    (blob, size), = store.blobs()
    _rewrite_name(store, "value/v", size=size + 1)
    assert store.get("value/v") is None
    assert "the name file" in said() and "is damaged" in said()
    assert store.blob_path(blob).exists()  # the blob is whole: it stays where it is
    assert store.check_blob(blob) is None


# -- the command: what to delete, and a store it cannot write --

def test_verify_on_a_missing_blob_names_the_name_file_to_delete(store, capsys):
    store.put("value/k1", torch.ones(3))
    store.put("value/k2", torch.ones(3))
    blob = store.entry("value/k1").blob
    store.blob_path(blob).unlink()
    assert store_cli(["verify", str(store.path)]) == 1
    err = capsys.readouterr().err
    assert str(store.name_path("value/k1")) in err and str(store.name_path("value/k2")) in err
    assert str(store.blob_path(blob)) not in err  # not a file that is not there
    store.name_path("value/k1").unlink()
    store.name_path("value/k2").unlink()
    assert store_cli(["verify", str(store.path)]) == 0


def _one_clear_line(err: str, store) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(store.path) in lines[0]


def test_gc_on_a_store_it_cannot_write_says_so_in_one_line_and_exits_1(store, capsys):
    # the lock file is a directory: a failure to write that stops root too
    store.put("value/k", torch.ones(3))
    store.put("value/k", torch.zeros(3))  # the first blob is now unreferenced
    (store.path / "lock").unlink()
    (store.path / "lock").mkdir()
    assert store_cli(["gc", str(store.path)]) == 1
    _one_clear_line(capsys.readouterr().err, store)
    assert len(list(store.blobs())) == 2
    assert store_cli(["gc", "--dry-run", str(store.path)]) == 0  # a dry run writes nothing


def test_gc_on_a_read_only_store_says_so_in_one_line_and_exits_1(store):
    store.put("value/k", torch.ones(3))
    store.put("value/k", torch.zeros(3))
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no mount namespace here (unshare -m) to make a read-only mount")
    p = str(store.path)
    script = (f"mount --bind {p} {p} && mount -o remount,ro,bind {p} && "
              f"exec {sys.executable} -m somatize store gc {p}")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    _one_clear_line(out.stderr, store)
    assert "Read-only file system" in out.stderr
    assert len(list(store.blobs())) == 2
