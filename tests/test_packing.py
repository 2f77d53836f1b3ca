"""Packing: the aligned layout, and a reader that trusts nothing it reads (crafted headers,
and a property-based fuzz of ``unpack`` over random, crafted and mutated files)."""

import json
import math
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import safetensors
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import somatize.torch  # noqa: F401  (registers the tensor's codec)
from somatize import codec
from somatize._packing import (
    ALIGN,
    SIZES,
    Damaged,
    Unpackable,
    address,
    aligned,
    check,
    pack,
    unpack,
)
from somatize._values import Blob, _codecs


def packed(value) -> bytes:
    header, buffers = pack(value)
    return header + b"".join(bytes(b) for b in buffers)


def in_aligned(raw: bytes) -> memoryview:
    buf = aligned(len(raw))
    buf[:] = raw
    return buf


def header_of(raw: bytes) -> dict:
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n])


def crafted(header: dict, data: bytes = b"", structure=None, raw_header: bytes | None = None):
    """A file with this header (``__metadata__`` holding ``structure``) and these bytes."""
    if structure is not None:
        header = {"__metadata__": {"somatize/1": json.dumps(structure)}, **header}
    text = json.dumps(header).encode() if raw_header is None else raw_header
    return struct.pack("<Q", len(text)) + text + data


MIXED = {
    "f32": torch.randn(3, 5), "f64": torch.randn(7, dtype=torch.float64),
    "i16": torch.arange(11, dtype=torch.int16), "half": torch.randn(13, dtype=torch.float16),
    "mask": torch.tensor([True, False, True]), "bf": torch.randn(5, dtype=torch.bfloat16),
    "c64": torch.randn(3, dtype=torch.complex64), "raw": b"\x01\x02\x03",
    "empty": torch.empty(0, 3), "u8": torch.arange(9, dtype=torch.uint8),
}


# -- the layout --

def test_every_tensor_starts_at_a_multiple_of_64_bytes_in_the_file():
    raw = packed(MIXED)
    header = header_of(raw)
    (n,) = struct.unpack_from("<Q", raw)
    assert (8 + n) % ALIGN == 0  # the data starts aligned
    tensors = {k: t["data_offsets"] for k, t in header.items()
               if k != "__metadata__" and not k.startswith("__pad_")}
    assert len(tensors) == len(MIXED)
    assert all(start % ALIGN == 0 for start, end in tensors.values() if end > start)
    assert any(k.startswith("__pad_") for k in header)  # the gaps are entries of their own


def test_the_aligned_layout_is_a_file_the_safetensors_library_reads():
    raw = packed(MIXED)
    tensors = dict(safetensors.deserialize(raw))
    header = header_of(raw)
    for name, t in tensors.items():
        assert t["dtype"] == header[name]["dtype"] and t["shape"] == header[name]["shape"]


def test_every_tensor_unpacked_from_an_aligned_buffer_is_aligned_and_equal():
    back = unpack(in_aligned(packed(MIXED)))
    for k, v in MIXED.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
            assert back[k].data_ptr() % ALIGN == 0, k
    assert back["raw"] == MIXED["raw"]


def test_tensors_from_an_unaligned_or_read_only_buffer_are_copied_aligned():
    raw = packed({"a": torch.randn(5), "b": torch.randn(3, dtype=torch.float64)})
    skewed = aligned(len(raw) + 8)[8:]  # writable, 8 bytes past a multiple of 64
    skewed[:] = raw
    for buf in (skewed, memoryview(raw)):
        back = unpack(buf)
        assert back["a"].data_ptr() % ALIGN == 0 and back["b"].data_ptr() % ALIGN == 0


def test_an_aligned_buffer_starts_at_a_multiple_of_64():
    for n in (0, 1, 63, 64, 1000, 1 << 20):
        buf = aligned(n)
        assert len(buf) == n and not buf.readonly
        if n:
            assert address(buf) % ALIGN == 0


def test_a_value_nested_past_64_containers_is_refused_when_packed():
    deep = []
    for _ in range(70):
        deep = [deep]
    with pytest.raises(ValueError, match="nested more than 64"):
        pack(deep)


def test_a_codec_whose_bytes_do_not_fit_its_shape_is_refused_when_packed():
    class Liar:
        pass

    codec("liar", Liar, dump=lambda v: Blob("F32", (4096,), b""), load=lambda b: None)
    try:
        with pytest.raises(ValueError, match="came with 0 bytes"):
            pack({"x": Liar()})
    finally:
        _codecs.pop("liar")


# -- what a crafted file cannot do --

F32_4096 = {"t": {"dtype": "F32", "shape": [4096], "data_offsets": [0, 0]}}
OK_TENSOR = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
TENSOR_AT_T = {"o": "tensor", "at": "t"}


def deep_structure(depth):
    s = None
    for _ in range(depth):
        s = {"l": [s]}
    return s


CRAFTED = {
    "offsets claiming no bytes for 4096 floats": crafted(F32_4096, b"", TENSOR_AT_T),
    "offsets past the end of the data": crafted(
        {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, TENSOR_AT_T),
    "offsets larger than shape x item size": crafted(
        {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, TENSOR_AT_T),
    "overlapping offsets": crafted(
        {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, TENSOR_AT_T),
    "a gap between tensors": crafted(
        {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
         "u": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12, TENSOR_AT_T),
    "trailing bytes after the tensors": crafted(OK_TENSOR, b"\0" * 12, TENSOR_AT_T),
    "an unknown dtype": crafted(
        {"t": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16, TENSOR_AT_T),
    "a negative shape": crafted(
        {"t": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}, b"\0" * 16,
        TENSOR_AT_T),
    "a shape that is not ints": crafted(
        {"t": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8, TENSOR_AT_T),
    "a header length beyond the file": struct.pack("<Q", 1 << 40) + b"{}",
    "fewer than 8 bytes": b"\x01\x02",
    "a header that is not UTF-8": crafted({}, raw_header=b"{\xff\xfe}"),
    "a header that is not JSON": crafted({}, raw_header=b"{not json"),
    "a header that is a JSON list": crafted({}, raw_header=b"[1, 2]"),
    "no __metadata__": crafted(OK_TENSOR, b"\0" * 8),
    "a __metadata__ that is not str to str": crafted(
        {"__metadata__": {"somatize/1": 7}, **OK_TENSOR}, b"\0" * 8),
    "a __metadata__ without the structure": crafted(
        {"__metadata__": {"format": "pt"}, **OK_TENSOR}, b"\0" * 8),
    "a key twice in the header": crafted({}, raw_header=(
        b'{"__metadata__":{"somatize/1":"null"},"t":{"dtype":"U8","shape":[1],'
        b'"data_offsets":[0,1]},"t":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}'),
        data=b"\0\0\0"),
    "an entry with another field": crafted(
        {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, b"\0" * 8,
        TENSOR_AT_T),
    "a structure nested 100 deep": crafted({}, b"", deep_structure(100)),
    "a structure nested 100000 deep": crafted({}, raw_header=(
        b'{"__metadata__":{"somatize/1":"' + b"[" * 100_000 + b'"}}')),
    "an empty tag": crafted({}, b"", {}),
    "an unknown tag": crafted({}, b"", {"z": 1}),
    "a tag with the wrong type": crafted({}, b"", {"l": "not a list"}),
    "a reference to no tensor": crafted(OK_TENSOR, b"\0" * 8, {"o": "tensor", "at": "nope"}),
    "an int that is not one": crafted({}, b"", {"i": "twelve"}),
    "a dict key that cannot be one": crafted({}, b"", {"d": [[{"l": []}, 1]]}),
}


@pytest.mark.parametrize("why", sorted(CRAFTED))
def test_a_crafted_file_is_damaged_never_read(why):
    raw = CRAFTED[why]
    with pytest.raises(Damaged):
        unpack(in_aligned(raw))
    with pytest.raises(Damaged):
        check(raw)


def test_the_file_of_the_issue_hashes_right_and_is_refused_like_safetensors_refuses_it():
    raw = CRAFTED["offsets claiming no bytes for 4096 floats"]
    with pytest.raises(safetensors.SafetensorError, match="invalid shape, data type, or offset"):
        safetensors.deserialize(raw)
    with pytest.raises(Damaged, match="needs 16384 bytes, its offsets give 0"):
        unpack(in_aligned(raw))


def test_a_codec_this_process_lacks_is_unpackable_not_damaged():
    raw = crafted(OK_TENSOR, b"\0" * 8, {"o": "somebody-elses", "at": "t"})
    with pytest.raises(Unpackable):
        unpack(in_aligned(raw))
    check(raw)  # not damage: only this process cannot read it


# -- fuzz: no bytes make unpack hand out memory it did not read, raise, or hang --

class Probe:
    """An object whose codec records the bytes it is handed."""


handed: list[Blob] = []
codec("probe", Probe, dump=lambda p: Blob("I16", (3,), memoryview(bytearray(6))),
      load=lambda b: handed.append(b) or Probe())


@pytest.fixture(autouse=True, scope="module")
def _forget_the_probe_codec():
    yield
    _codecs.pop("probe")


def _walk(v):
    if isinstance(v, (list, tuple)):
        for x in v:
            yield from _walk(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _walk(k)
            yield from _walk(x)
    else:
        yield v


def read_safely(raw: bytes) -> None:
    """unpack ``raw``; only its own errors may leave, and what it gives back was read."""
    buf = in_aligned(raw)
    start = address(buf) if raw else 0
    handed.clear()
    try:
        value = unpack(buf)
    except (Damaged, Unpackable):
        return
    safetensors.deserialize(raw)  # what it accepts, the safetensors library accepts too
    for b in handed:  # every blob a codec got lies inside the buffer and fits its shape
        mv = memoryview(b.data)
        assert mv.nbytes == math.prod(b.shape) * SIZES[b.dtype]
        if mv.nbytes:
            assert start <= address(mv) and address(mv) + mv.nbytes <= start + len(raw)
    for t in _walk(value):
        if isinstance(t, torch.Tensor) and t.numel():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            assert bytes(t.reshape(-1).view(torch.uint8).numpy()) in raw


FUZZ = settings(max_examples=250, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
SEEDS = [
    packed(MIXED),
    packed({"p": Probe(), "l": [1, 2.5, None, "s", (True, b"ab")], "t": torch.ones(2, 3)}),
    packed([torch.arange(4, dtype=torch.int64), Probe(), {"k": torch.zeros(0)}]),
    packed(3),
]


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_never_make_unpack_misbehave(raw):
    read_safely(raw)


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_behind_a_plausible_length_never_make_unpack_misbehave(tail):
    read_safely(struct.pack("<Q", len(tail) // 2) + tail)


def _edit_header(draw, header: dict) -> None:
    """One edit that keeps the header JSON: an offset, a shape, a dtype, an entry, a tag."""
    names = [k for k in header if k != "__metadata__"]
    how = draw(st.sampled_from(["offset", "shape", "dtype", "drop", "copy", "tag", "meta"]))
    if names and how in ("offset", "shape", "dtype", "drop", "copy"):
        t = header[draw(st.sampled_from(names))]
        if how == "offset":
            t["data_offsets"][draw(st.integers(0, 1))] += draw(st.integers(-70, 70))
        elif how == "shape":
            t["shape"] = draw(st.lists(st.integers(-1, 9), max_size=3))
        elif how == "dtype":
            t["dtype"] = draw(st.sampled_from([*SIZES, "F4", "x"]))
        elif how == "drop":
            del header[draw(st.sampled_from(names))]
        else:
            header[draw(st.sampled_from(["zz", *names]))] = json.loads(json.dumps(t))
    elif how != "meta" and isinstance(header.get("__metadata__"), dict) and isinstance(
            header["__metadata__"].get("somatize/1"), str):
        text = header["__metadata__"]["somatize/1"]
        for old, new in draw(st.lists(st.sampled_from([
                ('"l"', '"t"'), ('"t"', '"l"'), ('"at"', '"x"'), ('"o"', '"b"'), ('"b"', '"o"'),
                ('"i"', '"f"'), ('"d"', '"l"'), ('"0"', '"1"'), ('"1"', '"0"'), ('"1"', '"9"'),
                ('"tensor"', '"probe"'), ('"probe"', '"tensor"'), ("[", "[["), ("]", "]]"),
                (":", ':{"l":'), ("}", "}}")]), min_size=1, max_size=2)):
            text = text.replace(old, new, 1)
        header["__metadata__"]["somatize/1"] = text
    else:
        header["__metadata__"] = draw(st.sampled_from([{}, {"somatize/1": 1}, None, []]))


@st.composite
def mutations(draw):
    raw = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        (n,) = struct.unpack_from("<Q", raw) if len(raw) >= 8 else (0,)
        how = draw(st.sampled_from(["flip", "flip-data", "truncate", "insert", "delete",
                                    "header", "header", "header"]))
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        if how == "flip":
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif how == "flip-data" and 8 + n < len(raw):  # the tensors' bytes, not the header
            raw[draw(st.integers(8 + n, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif how == "truncate":
            del raw[i:]
        elif how == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif how == "delete":
            del raw[i:i + draw(st.integers(1, 8))]
        elif how == "header":
            try:
                header = json.loads(bytes(raw[8:8 + n]))
            except ValueError:
                continue
            _edit_header(draw, header)
            text = json.dumps(header).encode()
            raw[:8 + n] = struct.pack("<Q", len(text)) + text
    return bytes(raw)


@FUZZ
@given(mutations())
def test_mutated_packed_files_never_make_unpack_misbehave(raw):
    read_safely(raw)


tags = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3)
    | st.builds(lambda s: {"i": s}, st.text(max_size=4))
    | st.builds(lambda s: {"o": s, "at": "t"}, st.sampled_from(["tensor", "probe", "x"]))
    | st.builds(lambda s: {"b": s}, st.sampled_from(["t", "u", "__pad_0__", "zz"]))
    | st.dictionaries(st.sampled_from(["", "z", "o", "at", "i"]), st.integers(), max_size=2),
    lambda inner: st.builds(lambda v: {"l": v}, st.lists(inner, max_size=3))
    | st.builds(lambda v: {"t": v}, st.lists(inner, max_size=3))
    | st.builds(lambda kv: {"d": kv}, st.lists(st.lists(inner, min_size=1, max_size=3),
                                                max_size=2))
    | st.builds(lambda p, k, kv: {"c": [p, k, kv]},
                st.sampled_from(["builtins:dict", "collections:OrderedDict", "os:PathLike",
                                 "test_packing:Point", "never_imported_q:X", "x", ""]),
                st.sampled_from(["namedtuple", "dataclass", "mapping", "zz"]),
                st.lists(st.lists(inner | st.sampled_from(["x", "y"]), min_size=1, max_size=3),
                         max_size=2)),
    max_leaves=10)


@st.composite
def headers(draw):
    """Entries with offsets either honest (back to back, fitting their shapes) or not."""
    header, end = {}, 0
    for name in draw(st.lists(st.sampled_from(["t", "u", "__pad_0__"]), unique=True,
                              max_size=3)):
        dtype = draw(st.sampled_from([*SIZES, "F4", "Q", ""]))
        shape = draw(st.lists(st.integers(-2, 6), max_size=3))
        size = math.prod(shape) * SIZES.get(dtype, 1)
        offsets = [end, end + size] if draw(st.booleans()) else draw(
            st.lists(st.integers(-1, 80), min_size=2, max_size=2))
        end = max(end, offsets[1])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    return header, end + draw(st.sampled_from([0, 0, 0, 1, -1]))


@FUZZ
@given(headers(), tags, st.binary(min_size=80, max_size=80))
def test_crafted_headers_never_make_unpack_misbehave(header_and_size, structure, data):
    header, size = header_and_size
    raw = crafted({"__metadata__": {"somatize/1": json.dumps(structure)}, **header},
                  data[:max(size, 0)] if size <= 80 else data)
    read_safely(raw)


# -- classes kept as data --

class Point(NamedTuple):
    x: Any
    y: Any


@dataclass(frozen=True)
class Box:
    inner: Any
    n: int = 0
    seen: list = field(default_factory=list, init=False)


class Attrs(OrderedDict):
    def __getattr__(self, k):
        return self[k]


def test_namedtuples_dataclasses_and_mappings_come_back_as_their_own_classes_nested():
    value = {"p": Point(Box(torch.ones(2), 3), Attrs(a=Point(1, [2.5, "s"]))), "plain": (1, 2)}
    back = unpack(in_aligned(packed(value)))
    assert type(back["p"]) is Point and type(back["p"].x) is Box and back["p"].x.n == 3
    assert torch.equal(back["p"].x.inner, torch.ones(2)) and back["p"].x.seen == []
    assert type(back["p"].y) is Attrs and back["p"].y.a == Point(1, [2.5, "s"])
    assert type(back["plain"]) is tuple and back["plain"] == (1, 2)
    assert "Point" in header_of(packed(value))["__metadata__"]["somatize/1"]  # as data


def test_a_class_that_could_not_come_back_as_it_is_is_refused_when_packed():
    class Local(NamedTuple):
        a: int

    with pytest.raises(ValueError, match="defined inside a function"):
        pack(Local(1))
    extra = Attrs(a=1)
    extra.__dict__["note"] = "kept nowhere"
    with pytest.raises(ValueError, match=r"attributes beyond its mapping fields \(\['note'\]\)"):
        pack(extra)


def test_reading_a_class_never_imports_it_and_verify_finds_no_damage():
    raw = crafted({}, structure={"c": ["never_imported_q:X", "namedtuple", [["a", 1]]]})
    with pytest.raises(Unpackable, match="is not imported in this process"):
        unpack(in_aligned(raw))
    check(in_aligned(raw))  # not damage
    assert "never_imported_q" not in sys.modules
