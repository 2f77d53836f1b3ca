"""The tensor's codec, registered when ``somatize.torch`` is imported: a tensor becomes a
safetensors dtype, a shape and its bytes (read in place, never copied), and back.

    blob = to_blob(t); torch.equal(from_blob(blob), t)

A tensor given back starts 64-byte aligned: it shares the bytes it was read from when
they are (the store lays its blobs out so), else it is copied into memory that is (the
CPU matrix kernels round unaligned float32 input differently in the last bit).
"""

from __future__ import annotations

import torch

from .._packing import ALIGN, SIZES
from .._values import Blob, codec

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
assert set(TORCH_DTYPES) <= set(SIZES), "every codec dtype is one the one table sizes"


def to_blob(t: torch.Tensor) -> Blob:
    """A tensor as bytes: on the CPU, contiguous, viewed as bytes without a copy.

    Raises ``TypeError`` for what no safetensors file holds (a sparse or quantized tensor,
    complex128); a conjugate or negative view is resolved (a copy) first.
    """
    if t.layout != torch.strided:
        raise TypeError(f"a {t.layout} tensor cannot be kept (only dense tensors): "
                        "call .to_dense() on it first")
    if t.dtype not in DTYPES:
        raise TypeError(f"tensors of dtype {t.dtype} cannot be kept (no safetensors dtype)")
    if t.device.type == "meta":
        raise TypeError("a tensor on the meta device has no data to keep")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()  # the bits a view flips lazily, applied
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return Blob(DTYPES[t.dtype], tuple(t.shape), memoryview(data) if t.numel() else data)


def from_blob(blob: Blob) -> torch.Tensor:
    """A tensor from bytes, on the CPU, a leaf, 64-byte aligned; shares the buffer when it
    is writable and aligned, else copies it."""
    dtype = TORCH_DTYPES[blob.dtype]
    data = memoryview(blob.data)
    if not data.nbytes:
        return torch.empty(blob.shape, dtype=dtype)
    if data.readonly:  # a tensor may be written to: never over bytes someone else owns
        raw = torch.empty(data.nbytes, dtype=torch.uint8)  # torch's allocator aligns to 64
        memoryview(raw.numpy())[:] = data.cast("B") if data.format != "B" else data
    else:
        raw = torch.frombuffer(data, dtype=torch.uint8)
        if raw.data_ptr() % ALIGN:
            raw = raw.clone()  # a blob from before the store aligned its layout
    return raw.view(dtype).reshape(blob.shape)


def layout(t: torch.Tensor) -> str:
    """A tensor's strides where they are not its contiguous copy's ("" where they are): a
    kernel given a transposed or channels-last input may round otherwise (a Linear on
    ``x.t()`` and on ``x.t().contiguous()`` differ in the last bit)."""
    return "" if t.is_contiguous() else f"strides{t.stride()}"


codec("tensor", torch.Tensor, dump=to_blob, load=from_blob, layout=layout)
