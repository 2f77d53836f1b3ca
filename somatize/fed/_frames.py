"""The study link's messages, without pickle or protobuf: a typed control header (JSON)
and tensors as raw dtype, shape and bytes. Whatever does not parse as one of the known
kinds, dtypes and shapes is refused before anything runs.

    data = encode("Forward", {"round": 0, "step": 3}, {"x": activations})
    kind, fields, tensors = decode(data)      # or FrameError naming what was wrong
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch

from .._errors import Refused

MAGIC = b"SMZF\x01"
KINDS = frozenset({"Attach", "Attached", "Forward", "Output", "Backward", "Grad", "RoundEnd",
                   "Average", "Detach", "Refused", "Done"})
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
          "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 1 << 20


class FrameError(Refused):
    """A message that is not one of the study link's frames (junk, a pickle, a lie about
    its sizes): refused, never run."""


def encode(kind: str, fields: Mapping | None = None,
           tensors: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """One message: ``kind`` (one of ``KINDS``), JSON ``fields``, and named tensors."""
    if kind not in KINDS:
        raise FrameError(f"no message kind {kind!r}: the study link knows {sorted(KINDS)}")
    specs, blobs = [], []
    for name, t in (tensors or {}).items():
        if t.dtype not in NAMES:
            raise FrameError(f"tensor {name!r} is {t.dtype}: the study link carries "
                             f"{sorted(DTYPES)}")
        t = t.detach().cpu().contiguous()
        specs.append([name, NAMES[t.dtype], list(t.shape)])
        blobs.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    header = json.dumps({"kind": kind, "fields": dict(fields or {}), "tensors": specs},
                        separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack(">I", len(header)), header, *blobs])


def decode(data: bytes, kinds: frozenset = KINDS
           ) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """``(kind, fields, tensors)`` of a message made by ``encode``; FrameError for
    anything else (checked before a byte of it is used)."""
    if not isinstance(data, (bytes, bytearray)) or not data.startswith(MAGIC):
        raise FrameError("not a study-link frame (it does not start with SMZF\\x01): junk, "
                         "a pickle or another protocol; nothing of it was read")
    if len(data) < len(MAGIC) + 4:
        raise FrameError("a study-link frame cut short")
    (n,) = struct.unpack(">I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if n > MAX_HEADER or start + n > len(data):
        raise FrameError(f"a frame header of {n} bytes in a message of {len(data)}")
    try:
        header = json.loads(data[start:start + n].decode())
        kind, fields, specs = header["kind"], header["fields"], header["tensors"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise FrameError("a frame whose header is not the study link's JSON") from None
    if kind not in kinds or not isinstance(fields, dict) or not isinstance(specs, list):
        raise FrameError(f"a frame of kind {kind!r} where {sorted(kinds)} are expected")
    pos, tensors = start + n, {}
    for spec in specs:
        ok = (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
              and spec[1] in DTYPES and isinstance(spec[2], list)
              and all(isinstance(d, int) and 0 <= d < 1 << 40 for d in spec[2]))
        if not ok:
            raise FrameError(f"a tensor described as {str(spec)[:80]}: not (name, dtype, shape)")
        name, dtype, shape = spec[0], DTYPES[spec[1]], spec[2]
        count = 1
        for d in shape:
            count *= d
        size = count * torch.empty((), dtype=dtype).element_size()
        if pos + size > len(data):
            raise FrameError(f"tensor {name!r} {shape} {spec[1]} needs {size} bytes; the "
                             f"frame has {len(data) - pos} left")
        raw = bytearray(data[pos:pos + size])
        t = torch.frombuffer(raw, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(shape)
        pos += size
    if pos != len(data):
        raise FrameError(f"{len(data) - pos} bytes after the frame's last tensor")
    return kind, fields, tensors


class Refusal(Exception):
    """What the hub answers instead of running a message: ``code``, one line, and
    typed ``fields`` (``excluded``: the round left out of, and the round to rejoin at)."""

    def __init__(self, code: str, message: str, **fields: int | str):
        super().__init__(message)
        self.code, self.fields = code, fields
