"""Large tensors between processes of one host through shared memory, not the socket.

    table, header = carried(tensors)     # sender: big CPU tensors copied into its slots
    table = received(header, table)      # receiver: each one a view of the sender's slot

A run on loopback has every process on this host. There, a CPU tensor of ``FROM`` bytes
or more in a call or an answer is copied once into a slot of the sender (a memfd of its
own, mapped and kept), and the message carries where it is (the slot's process, fd and
id, its bytes, dtype, shape) inside the bytes the MAC covers; the receiver opens the
slot through ``/proc/<pid>/fd/<fd>``, once, and hands out a tensor over its pages: no
copy on that side, and no page faulted in. TensorPipe receives each message into a fresh
buffer, whose page faults cap it near 4 GB/s here (docs/performance.md).

A slot carries one tensor at a time: its state byte is set when it is sent and cleared
by the receiver when the last tensor over it is freed; the sender reuses only a clear
one, else makes another, up to ``POOL`` bytes of slots (past it: the socket, as before).
A memfd is gone with the processes that hold it: kill -9 leaves nothing in /dev/shm. A
forked child starts with no slot of its own, and never clears one of its parent's.
``SOMATIZE_SHM=0`` turns it off (every tensor through TensorPipe).
"""

from __future__ import annotations

import json
import mmap
import os
import random
import threading
import weakref

HEADER = 4096  # a slot's first page: its id (8 bytes), its state byte; then the tensor
FROM = int(os.environ.get("SOMATIZE_SHM_FROM", 1 << 20))  # bytes: smaller ones keep the socket
POOL = int(os.environ.get("SOMATIZE_SHM_POOL", 2 << 30))  # bytes of slots a sender makes
_on = [False]
_lock = threading.Lock()
sent = [0]  # tensors this process sent through its slots


def enable(local: bool) -> None:
    """Carry big tensors through shared memory from now on, where every peer is on this
    host (``local``: the run is on loopback) and the kernel has memfds."""
    _on[0] = bool(local) and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd") \
        and os.environ.get("SOMATIZE_SHM", "1") != "0"


def enabled() -> bool:
    return _on[0]


class _Slot:
    __slots__ = ("fd", "id", "cap", "map")

    def __init__(self, cap: int):
        self.fd = os.memfd_create("somatize-slot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER + cap)
        self.map = mmap.mmap(self.fd, HEADER + cap)
        self.id, self.cap = random.getrandbits(63) + 1, cap
        self.map[:8] = self.id.to_bytes(8, "little")

    def free(self) -> bool:
        return self.map[8] == 0


_slots: list[_Slot] = []


def _slot_for(nbytes: int) -> _Slot | None:
    """A clear slot that holds ``nbytes`` (the smallest), else a new one; None past POOL."""
    fit = [s for s in _slots if s.cap >= nbytes and s.free()]
    if fit:
        return min(fit, key=lambda s: s.cap)
    cap = max(FROM, 1 << (nbytes - 1).bit_length())
    if sum(s.cap for s in _slots) + cap > POOL:
        return None
    slot = _Slot(cap)
    _slots.append(slot)
    return slot


def carried(tensors: list) -> tuple[list, bytes]:
    """The tensor table to send, each big CPU tensor in it replaced by an empty one, and
    the header that says where each replaced one is (b"" when none is)."""
    import torch  # noqa: PLC0415 - the core never gets here

    if not _on[0]:
        return tensors, b""
    big = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and t.layout ==
           torch.strided and not t.is_quantized and t.numel() * t.element_size() >= FROM
           and _dense(t.shape, t.stride())]
    if not big:
        return tensors, b""
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    out, entries = list(tensors), []
    with _lock:
        for i in big:
            t = tensors[i]
            if storages.count(storages[i]) > 1:
                continue  # sharing its storage with another one: TensorPipe keeps that
            nbytes = t.numel() * t.element_size()
            slot = _slot_for(nbytes)
            if slot is None:
                break  # the pool is full: the rest through the socket
            slot.map[8] = 1  # in flight until the receiver frees it
            dst = torch.frombuffer(slot.map, dtype=torch.uint8, count=nbytes, offset=HEADER)
            dst = dst.view(t.dtype).as_strided(t.shape, t.stride())  # its strides kept
            dst.copy_(t.detach())
            entries.append([i, os.getpid(), slot.fd, slot.id, nbytes, str(t.dtype)[6:],
                            list(t.shape), list(t.stride()), bool(t.requires_grad)])
            out[i] = torch.empty(0, dtype=t.dtype)
            sent[0] += 1
    return out, (json.dumps(entries).encode() if entries else b"")


def _dense(shape, stride) -> bool:
    """Whether the elements fill their span once each (a contiguous tensor, or one whose
    dims are permuted): TensorPipe sends those as they are, strides kept; any other view
    keeps the socket."""
    want = 1
    dims = (p for p in zip(shape, stride, strict=True) if p[0] != 1)
    for size, st in sorted(dims, key=lambda p: p[1]):
        if st != want:
            return False
        want *= size
    return True


_maps: dict[tuple[int, int], mmap.mmap] = {}  # (pid, fd) -> the slot mapped here


def received(header: bytes, table: list) -> list:
    """``table`` with each tensor the header names put back: a view of the sender's slot,
    whose state is cleared when the last tensor over it is freed here."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    table = list(table)
    for i, pid, fd, sid, nbytes, dtype, shape, stride, grad in json.loads(header):
        m = _mapped(pid, fd, sid, nbytes)
        arr = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=HEADER)
        weakref.finalize(arr, _clear, m, os.getpid()).atexit = False
        t = torch.from_numpy(arr).view(getattr(torch, dtype)).as_strided(shape, stride)
        table[i] = t.requires_grad_() if grad else t
    return table


def _mapped(pid: int, fd: int, sid: int, nbytes: int) -> mmap.mmap:
    m = _maps.get((pid, fd))
    if m is None or int.from_bytes(m[:8], "little") != sid or len(m) < HEADER + nbytes:
        try:
            with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
                m = mmap.mmap(f.fileno(), 0)
        except OSError as e:
            raise RuntimeError(
                f"a tensor of {nbytes} bytes was sent through shared memory by process {pid}, "
                f"but this process cannot open it ({e}): is it in another container or pid "
                "namespace? Start every process of the run with SOMATIZE_SHM=0 (tensors "
                "then travel through the socket)") from e
        if int.from_bytes(m[:8], "little") != sid or len(m) < HEADER + nbytes:
            raise RuntimeError(f"the shared-memory slot {fd} of process {pid} is not the one "
                               "its message names: start the run with SOMATIZE_SHM=0")
        _maps[(pid, fd)] = m
    return m


def _clear(m: mmap.mmap, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child letting go of its copy: the parent may still hold it
    try:
        m[8] = 0  # the sender may use this slot again
    except (ValueError, TypeError):  # closed at exit
        pass


def _forked() -> None:
    """In a forked child: the parent's slots are the parent's (its next message may be
    written into any of them), and what it mapped is for it to let go."""
    _slots.clear()
    _maps.clear()
    sent[0] = 0


os.register_at_fork(after_in_child=_forked)
