"""Packing: a value as ONE safetensors file, written and parsed by hand (no torch here).
The one safetensors writer (``header``) and reader (``parse_header``) of the package, and
its one table of dtypes (``SIZES``): the store's packs use them too.

Objects with a codec (tensors, once ``somatize.torch`` is imported) become safetensors
tensors; the nested structure around them (dicts, lists, tuples, numbers, strings,
None, bytes) is JSON in the header's ``__metadata__``. Reading never unpickles.
NamedTuples, dataclasses and mappings of their own class (``ModelOutput``) are written as
data too, their class by its path and their fields by name; reading rebuilds them only
from a class already imported in the process (never importing anything), and only one
that still is a namedtuple, dataclass or mapping with those fields (see ``_classes``).

    header, buffers = pack({"emb": t, "n": 3})    # bytes, then memoryviews (no copy)
    buf = aligned(len(file_bytes)); buf[:] = file_bytes
    value = unpack(buf)                            # {"emb": tensor, "n": 3}

The layout is the safetensors one: an 8-byte little-endian header length, the JSON
header (padded with spaces), then the tensors' bytes back to back. Every tensor starts
at a multiple of 64 bytes from the start of the file: the header is padded so the data
starts there, and padding entries of their own (``__pad_<i>__``, U8, never read) fill
the gaps, since safetensors allows none. Read from a buffer that starts 64-aligned (an
mmap, :func:`aligned`), every tensor is then 64-aligned in memory, which matters: the
CPU matrix kernels round an unaligned float32 input differently in the last bit, so a
value read back would change the numbers computed from it.

``unpack`` trusts nothing it reads (a store may be shared): it checks what the
safetensors library checks (header length, UTF-8 JSON, known dtypes, shapes of
non-negative ints, offsets covering exactly shape x item size, back to back, ending at
the end of the buffer) and the structure (known tags, references to real entries,
nesting at most 64 deep). Anything else raises :class:`Damaged`; a codec this process
lacks raises :class:`Unpackable`. No other exception leaves it.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from typing import Any

from ._classes import class_of, rebuild
from ._values import Blob, Opaque, codec_for, codec_named

FORMAT = "somatize/1"  # the key in __metadata__ that holds the structure
ALIGN = 64  # every tensor starts at a multiple of this, from the start of the file
MAX_DEPTH = 64  # containers nested deeper than this are neither packed nor read
_MAX_HEADER = 100_000_000  # the safetensors library's own limit
_LEN = struct.Struct("<Q")
# the dtypes a file may hold, and their item sizes (safetensors' byte-sized ones)
SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
         "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
         "C64": 8}
_ZEROS = memoryview(bytes(ALIGN))


class Unpackable(Exception):
    """A value holds an object no codec knows (``.kind`` says which type), or a class this
    process cannot rebuild (``.why`` says why and what to do)."""

    def __init__(self, kind: str, why: str | None = None):
        super().__init__(kind if why is None else f"{kind}: {why}")
        self.kind, self.why = kind, why


class Damaged(Exception):
    """The bytes are not a packed value (bad header, bad offsets, unknown tag...)."""


def aligned(n: int) -> memoryview:
    """A writable, zeroed buffer of ``n`` bytes that starts at a multiple of 64."""
    raw = bytearray(n + ALIGN)
    skip = -address(raw) % ALIGN
    return memoryview(raw)[skip:skip + n]  # the slice keeps ``raw`` alive


def address(buf: Any) -> int:
    """Where a writable, non-empty buffer starts in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


# -- writing --

def pack(value: Any) -> tuple[bytes, list[memoryview]]:
    """The header bytes (length prefix included) and the tensors' buffers, in order.

    Raises ``Unpackable`` for an object no codec knows, ``ValueError`` for a value that
    could not be read back (nested too deep, a codec answering bytes that do not fit).
    """
    blobs: list[Blob] = []
    structure = _encode(value, blobs, 0)
    tensors = [(str(i), blob.dtype, blob.shape, _bytes_of(blob)) for i, blob in enumerate(blobs)]
    return header({FORMAT: json.dumps(structure, separators=(",", ":"))}, tensors, align=True)


def header(meta: dict[str, str], tensors: list[tuple[str, str, Any, Any]],
           align: bool = False) -> tuple[bytes, list[memoryview]]:
    """The one safetensors writer: the header (length prefix included, padded so the
    data starts 64-aligned) of ``tensors`` (``(name, dtype, shape, bytes)``, laid out back
    to back in that order) with ``meta`` as its ``__metadata__``, and the buffers to write
    after it. ``align``: every tensor starts at a multiple of 64 (gaps filled by padding
    entries of their own, ``__pad_<i>__``)."""
    head: dict[str, Any] = {"__metadata__": dict(meta)}
    buffers: list[memoryview] = []
    offset = 0
    for i, (name, dtype, shape, data) in enumerate(tensors):
        mv = memoryview(data).cast("B") if memoryview(data).nbytes else memoryview(b"")
        if dtype not in SIZES or math.prod(shape) * SIZES[dtype] != mv.nbytes:
            raise ValueError(f"tensor {name!r}: {mv.nbytes} bytes are not a {dtype} of "
                             f"shape {list(shape)}")
        gap = -offset % ALIGN if align else 0
        if gap and mv.nbytes:
            head[f"__pad_{i}__"] = {"dtype": "U8", "shape": [gap],
                                    "data_offsets": [offset, offset + gap]}
            buffers.append(_ZEROS[:gap])
            offset += gap
        head[name] = {"dtype": dtype, "shape": list(shape),
                      "data_offsets": [offset, offset + mv.nbytes]}
        buffers.append(mv)
        offset += mv.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-(_LEN.size + len(text)) % ALIGN)  # the data starts 64-aligned
    return _LEN.pack(len(text)) + text, buffers


def _bytes_of(blob: Blob) -> memoryview:
    mv = memoryview(blob.data)
    mv = mv.cast("B") if mv.nbytes and (mv.format != "B" or mv.ndim != 1) else mv
    if blob.dtype not in SIZES:
        raise ValueError(f"dtype {blob.dtype!r} is not one a safetensors file can hold")
    if math.prod(blob.shape) * SIZES[blob.dtype] != mv.nbytes:
        raise ValueError(f"a {blob.dtype} of shape {list(blob.shape)} came with "
                         f"{mv.nbytes} bytes (its codec's dump is wrong)")
    return mv if mv.nbytes else memoryview(b"")


def _encode(value: Any, blobs: list, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"containers nested more than {MAX_DEPTH} deep cannot be kept")
    if isinstance(value, Opaque):
        value = value.value
    if value is None or isinstance(value, (bool, str)):
        return value
    kept_as = class_of(value)  # a namedtuple, dataclass or mapping of its own class
    if kept_as is not None:
        path, kind, items = kept_as
        return {"c": [path, kind, [[_encode(k, blobs, depth + 1), _encode(v, blobs, depth + 1)]
                                   for k, v in items]]}
    if isinstance(value, int):
        return {"i": str(value)}  # as a string: JSON readers elsewhere lose big ints
    if isinstance(value, float):
        return {"f": repr(value)} if not math.isfinite(value) else value
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "t":
                [_encode(v, blobs, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_encode(k, blobs, depth + 1), _encode(v, blobs, depth + 1)]
                      for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        blobs.append(Blob("U8", (len(value),), value))
        return {"b": str(len(blobs) - 1)}
    c = codec_for(value)
    if c is None:
        raise Unpackable(type(value).__qualname__)
    blobs.append(c.dump(value))
    return {"o": c.kind, "at": str(len(blobs) - 1)}


# -- reading --

def unpack(buf: Any) -> Any:
    """The value packed in ``buf``; tensors share ``buf`` (hand in a private, writable one,
    64-aligned for aligned tensors: :func:`aligned`, or an mmap)."""
    return _read(buf, strict=True)


def check(buf: Any) -> None:
    """Raise ``Damaged`` unless ``buf`` holds a packed value; objects whose codec this
    process lacks are not read (that is no damage)."""
    _read(buf, strict=False)


def _read(buf: Any, strict: bool) -> Any:
    buf = memoryview(buf)
    buf = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
    try:
        entries, structure, data = _read_header(buf)
        return _Reader(entries, data, strict).decode(structure, 0)
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError) as e:
        raise Damaged(f"{type(e).__name__}: {str(e)[:200]}") from None


def _read_header(buf: memoryview) -> tuple[dict, Any, memoryview]:
    n = header_length(bytes(buf[:_LEN.size]), len(buf))
    entries, meta = parse_header(bytes(buf[_LEN.size:_LEN.size + n]), len(buf) - _LEN.size - n)
    if FORMAT not in meta:
        raise Damaged(f"no {FORMAT!r} in __metadata__: not a value somatize packed")
    return entries, json.loads(meta[FORMAT]), buf[_LEN.size + n:]


def header_length(first: bytes, size: int) -> int:
    """The length of the JSON header, from a safetensors file's first 8 bytes and its size;
    raises ``Damaged`` when it cannot be one."""
    if len(first) < _LEN.size:
        raise Damaged(f"{size} bytes: too short for the 8-byte header length")
    (n,) = _LEN.unpack_from(first, 0)
    if n > min(_MAX_HEADER, size - _LEN.size):
        raise Damaged(f"a header of {n} bytes in a file of {size}")
    return n


def parse_header(text: bytes, data_size: int) -> tuple[dict, dict[str, str]]:
    """The one safetensors reader: a header's tensors ``{name: (dtype, shape, start,
    stop)}`` and its metadata, checked as the safetensors library checks them (UTF-8
    JSON, known dtypes, shapes of non-negative ints, offsets covering exactly shape x item
    size, back to back, ending at ``data_size``, the bytes after the header); raises
    ``Damaged`` otherwise."""
    try:
        decoded = text.decode("utf-8")
        if not decoded.startswith("{"):
            raise Damaged("the header is not a JSON object")
        head = json.loads(decoded)  # a key twice: the last one wins, the first leaves a gap
    except (UnicodeDecodeError, ValueError) as e:
        raise Damaged(f"the header does not parse ({type(e).__name__})") from None
    meta = head.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(
            type(k) is str and type(v) is str for k, v in meta.items()):
        raise Damaged("__metadata__ is missing or does not map strings to strings")
    entries = {name: _entry(name, t) for name, t in head.items()}
    end = 0
    for name, (_, _, start, stop) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if start != end:  # back to back: a gap or an overlap is not safetensors
            raise Damaged(f"tensor {name!r} starts at {start}, the one before ends at {end}")
        end = stop
    if end != data_size:
        raise Damaged(f"tensors end at {end}, the data is {data_size} bytes")
    return entries, meta


def _entry(name: str, t: Any) -> tuple[str, tuple[int, ...], int, int]:
    # plain loops, no generators: this runs for every tensor of every read
    if type(t) is not dict or len(t) != 3:
        raise Damaged(f"tensor {name!r}: not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
    nbytes = SIZES.get(dtype) if type(dtype) is str else None
    if nbytes is None:
        raise Damaged(f"tensor {name!r}: unknown dtype {str(dtype)[:20]!r}")
    if type(shape) is not list:
        raise Damaged(f"tensor {name!r}: shape {str(shape)[:40]} is not a list of sizes")
    for d in shape:
        if type(d) is not int or d < 0:
            raise Damaged(f"tensor {name!r}: shape {str(shape)[:40]} is not a list of sizes")
        nbytes *= d
    if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(
            offsets[1]) is not int or offsets[0] < 0:
        raise Damaged(f"tensor {name!r}: data_offsets {str(offsets)[:40]} is not [start, end]")
    start, stop = offsets
    if stop - start != nbytes:
        raise Damaged(f"tensor {name!r}: {dtype} {shape} needs {nbytes} bytes, its offsets "
                      f"give {stop - start}")
    return dtype, tuple(shape), start, stop


class _Reader:
    """Turns the structure back into a value, over the checked entries and their bytes."""

    def __init__(self, entries: dict, data: memoryview, strict: bool):
        self.entries, self.data, self.strict = entries, data, strict

    def decode(self, s: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise Damaged(f"the structure is nested more than {MAX_DEPTH} deep")
        if s is None or isinstance(s, (bool, str, int, float)):
            return s
        if not isinstance(s, dict):
            raise Damaged(f"a JSON {type(s).__name__} where a tagged value belongs")
        tag, v = next(iter(s.items())) if len(s) == 1 else ("o", s.get("o"))
        if tag == "i" and type(v) is str:
            return int(v)
        if tag == "f" and type(v) is str:
            return float(v)
        if tag in ("l", "t") and type(v) is list:
            items = [self.decode(x, depth + 1) for x in v]
            return items if tag == "l" else tuple(items)
        if tag == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            return {self.decode(k, depth + 1): self.decode(x, depth + 1) for k, x in v}
        if tag == "b" and type(v) is str:
            return bytes(self.bytes_at(v)[1])
        if tag == "c" and type(v) is list and len(v) == 3 and type(v[0]) is str and type(
                v[1]) is str and type(v[2]) is list and all(
                type(p) is list and len(p) == 2 for p in v[2]):
            items = [(self.decode(k, depth + 1), self.decode(x, depth + 1)) for k, x in v[2]]
            try:
                return rebuild(v[0], v[1], items)
            except LookupError as e:  # not damage: this process cannot rebuild the class
                if self.strict:
                    raise Unpackable(v[0], str(e)) from None
                return None
        if len(s) == 2 and type(v) is str and type(s.get("at")) is str:
            return self.load(v, s["at"])
        raise Damaged(f"an unknown or malformed tag: {json.dumps(s)[:60]}")

    def load(self, kind: str, at: str) -> Any:
        (dtype, shape), raw = self.bytes_at(at)
        c = codec_named(kind)
        if c is None:
            if self.strict:
                raise Unpackable(kind)
            return None
        try:
            return c.load(Blob(dtype, shape, raw))
        except Exception as e:  # the bytes fit the header: a codec refusing them is damage
            raise Damaged(f"the {kind!r} codec cannot read tensor {at!r} "
                          f"({type(e).__name__}: {str(e)[:200]})") from None

    def bytes_at(self, name: str) -> tuple[tuple[str, tuple[int, ...]], memoryview]:
        if name not in self.entries:
            raise Damaged(f"the structure refers to tensor {name[:20]!r}, which is not there")
        dtype, shape, start, stop = self.entries[name]
        return (dtype, shape), self.data[start:stop]
