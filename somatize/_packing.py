"""Packing: a value as ONE safetensors file, written and parsed by hand (no torch here).

Objects with a codec (tensors, once ``somatize.torch`` is imported) become safetensors
tensors; the nested structure around them (dicts, lists, tuples, numbers, strings,
None, bytes) is JSON in the header's ``__metadata__``. Reading never unpickles.

    header, buffers = pack({"emb": t, "n": 3})    # bytes, then memoryviews (no copy)
    value = unpack(memoryview(file_bytes))         # {"emb": tensor, "n": 3}

The layout is the safetensors one: an 8-byte little-endian header length, the JSON
header (padded with spaces to 8 bytes), then the tensors' bytes back to back.
Tensors are laid out widest dtype first, so each one starts aligned to its item size.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from ._values import Blob, Opaque, codec_for, codec_named

FORMAT = "somatize/1"  # the key in __metadata__ that holds the structure
_LEN = struct.Struct("<Q")
_WIDTH = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4,
          "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


class Unpackable(Exception):
    """A value holds an object no codec knows (``.kind`` says which type)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class Damaged(Exception):
    """The bytes are not a packed value (bad header, bad offsets, unknown codec)."""


def pack(value: Any) -> tuple[bytes, list[memoryview]]:
    """The header bytes (length prefix included) and the tensors' buffers, in order."""
    blobs: list[tuple[str, Blob]] = []
    structure = _encode(value, blobs)
    order = sorted(range(len(blobs)), key=lambda i: -_WIDTH.get(blobs[i][1].dtype, 1))
    header: dict[str, Any] = {"__metadata__": {FORMAT: json.dumps(structure)}}
    buffers: list[memoryview] = []
    offset = 0
    for i in order:
        kind, blob = blobs[i]
        mv = memoryview(blob.data).cast("B") if len(memoryview(blob.data)) else memoryview(b"")
        header[str(i)] = {"dtype": blob.dtype, "shape": list(blob.shape),
                          "data_offsets": [offset, offset + mv.nbytes]}
        offset += mv.nbytes
        buffers.append(mv)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors does
    return _LEN.pack(len(text)) + text, buffers


def unpack(buf: memoryview) -> Any:
    """The value packed in ``buf``; tensors share ``buf`` (hand in a private, writable one)."""
    buf = buf.cast("B") if buf.format != "B" else buf
    try:
        (n,) = _LEN.unpack_from(buf, 0)
        if n > len(buf) - 8:
            raise Damaged(f"header of {n} bytes in a file of {len(buf)}")
        header = json.loads(bytes(buf[8:8 + n]))
        structure = json.loads(header["__metadata__"][FORMAT])
        data = buf[8 + n:]
        ends = []
        for name, t in header.items():
            if name != "__metadata__":
                ends.append(t["data_offsets"][1])
        if max(ends, default=0) != len(data):
            raise Damaged(f"tensors end at {max(ends, default=0)}, data is {len(data)} bytes")
        return _decode(structure, header, data)
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise Damaged(f"{type(e).__name__}: {e}") from None


# -- the structure: scalars as JSON, containers and objects tagged --

def _encode(value: Any, blobs: list) -> Any:
    if isinstance(value, Opaque):
        value = value.value
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return {"i": str(value)}  # as a string: JSON readers elsewhere lose big ints
    if isinstance(value, float):
        return {"f": repr(value)} if not math.isfinite(value) else value
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "t": [_encode(v, blobs) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_encode(k, blobs), _encode(v, blobs)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        blobs.append(("bytes", Blob("U8", (len(value),), value)))
        return {"b": str(len(blobs) - 1)}
    c = codec_for(value)
    if c is None:
        raise Unpackable(type(value).__qualname__)
    blobs.append((c.kind, c.dump(value)))
    return {"o": c.kind, "at": str(len(blobs) - 1)}


def _decode(s: Any, header: dict, data: memoryview) -> Any:
    if s is None or isinstance(s, (bool, str, int, float)):
        return s
    tag = next(k for k in s if k != "at")
    if tag == "i":
        return int(s["i"])
    if tag == "f":
        return float(s["f"])
    if tag == "l":
        return [_decode(v, header, data) for v in s["l"]]
    if tag == "t":
        return tuple(_decode(v, header, data) for v in s["t"])
    if tag == "d":
        return {_decode(k, header, data): _decode(v, header, data) for k, v in s["d"]}
    if tag == "b":
        return bytes(_slice(header[s["b"]], data))
    if tag == "o":
        c = codec_named(s["o"])
        if c is None:
            raise Unpackable(s["o"])
        t = header[s["at"]]
        return c.load(Blob(t["dtype"], tuple(t["shape"]), _slice(t, data)))
    raise Damaged(f"unknown tag {tag!r}")


def _slice(t: dict, data: memoryview) -> memoryview:
    start, end = t["data_offsets"]
    if not 0 <= start <= end <= len(data):
        raise Damaged(f"tensor bytes {start}..{end} outside {len(data)}")
    return data[start:end]
