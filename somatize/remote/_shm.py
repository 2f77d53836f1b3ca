"""Large tensors between processes of one host through shared memory, not the socket.

    table, header = carried(tensors)     # sender: big CPU tensors copied into its slots
    table = received(header, table)      # receiver: each one over the sender's slot

A run on loopback has every process on this host. There, a CPU tensor of ``FROM`` bytes
or more in a call or an answer is copied once into a slot of the sender (a memfd of its
own, mapped and kept), and the message carries where it is (the slot's process, fd and
id, its bytes, dtype, shape) inside the bytes the MAC covers; the receiver opens the
slot through ``/proc/<pid>/fd/<fd>``, once, and hands out a tensor over its pages: no
copy on that side, and no page faulted in. TensorPipe receives each message into a fresh
buffer, whose page faults cap it near 4 GB/s here (docs/performance.md).

A slot carries one tensor at a time: its state byte is set when it is sent and cleared
by the receiver when the last tensor over it is freed; the sender reuses only a clear
one, else makes another, up to ``POOL`` bytes of slots (clear ones closed to make room;
past it: the socket, as before); clear slots keep their pages up to ``KEEP`` bytes, the
least recently used beyond it give theirs back (the memfd cut and grown again: gone for
the receiver too).
A memfd is gone with the processes that hold it: kill -9 leaves nothing in /dev/shm. A
forked child starts with no slot of its own and never clears one of its parent's; a
tensor received before a fork never clears its slot (the child holds the same pages).
Tensors that require grad stay on the socket (distributed autograd follows those).
``SOMATIZE_SHM=0`` turns it off (every tensor through TensorPipe). A worker joining
and its coordinator open each other's probe (``ticket``, ``opens``); where one cannot,
or has it off, neither sends through shared memory from then on (``_serve.joined``).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random
import threading
import weakref

HEADER = 4096  # a slot's first page: its id (8 bytes), its state byte; then the tensor
FROM = int(os.environ.get("SOMATIZE_SHM_FROM", 1 << 20))  # bytes: smaller ones keep the socket
POOL = int(os.environ.get("SOMATIZE_SHM_POOL", 2 << 30))  # bytes of slots a sender makes
KEEP = int(os.environ.get("SOMATIZE_SHM_KEEP", 256 << 20))  # of clear slots' pages kept
_ONE_THREAD = 4 << 20  # below: one memmove (23 us a MB here, copy_ 62); above, copy_
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
    __slots__ = ("fd", "id", "cap", "map", "at", "used", "resident")

    def __init__(self, cap: int):
        self.fd = os.memfd_create("somatize-slot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER + cap)
        self.map = mmap.mmap(self.fd, HEADER + cap)
        self.at = ctypes.addressof(ctypes.c_char.from_buffer(self.map)) + HEADER  # its bytes
        self.id, self.cap = random.getrandbits(63) + 1, cap
        self.map[:8] = self.id.to_bytes(8, "little")
        self.used, self.resident = 0, True

    def free(self) -> bool:
        return self.map[8] == 0

    def release(self) -> None:
        """Give its pages back: the memfd cut to its header and grown again (gone from
        every mapping of it, the receiver's too, whatever the page size); a later use
        faults them in again, as zeros. Only for a clear slot: nobody reads it."""
        if self.resident and self.cap:
            os.ftruncate(self.fd, HEADER)
            os.ftruncate(self.fd, HEADER + self.cap)
        self.resident = False

    def close(self) -> None:
        os.ftruncate(self.fd, HEADER)  # (a receiver's cached mapping keeps the memfd)
        self.map.close()
        os.close(self.fd)


_slots: list[_Slot] = []


_tick = [0]


def _slot_for(nbytes: int) -> _Slot | None:
    """A clear slot that holds ``nbytes`` (the smallest), else a new one (clear ones let
    go, least recently used first, to stay within POOL); None when they are not enough.
    Clear slots keep their pages up to KEEP bytes (the rest are given back)."""
    _tick[0] += 1
    clear = [s for s in _slots if s.free()]
    fit = [s for s in clear if s.cap >= nbytes]
    if fit:  # the smallest, one with its pages first
        slot = min(fit, key=lambda s: (s.cap, not s.resident))
    else:
        step = max(FROM, 1 << max((nbytes - 1).bit_length() - 3, 0))  # under 1/8 unused
        cap = -(-nbytes // step) * step
        total = sum(s.cap for s in _slots)
        if cap > POOL - (total - sum(s.cap for s in clear)):
            return None  # in flight, what is held leaves no room: keep the clear ones
        clear.sort(key=lambda s: (s.resident, s.used))  # those without pages, then oldest
        while total + cap > POOL:
            gone = clear.pop(0)
            _slots.remove(gone)
            gone.close()
            total -= gone.cap
        slot = _Slot(cap)
        _slots.append(slot)
    slot.used, slot.resident = _tick[0], True
    kept = sorted((s for s in clear if s is not slot and s.resident), key=lambda s: s.used)
    resident = sum(s.cap for s in kept)
    while kept and resident > KEEP:
        gone = kept.pop(0)
        resident -= gone.cap
        gone.release()
    return slot


_probe: list[_Slot] = []


def ticket() -> list | None:
    """Where a peer finds this process's probe (a slot of no bytes), to see that it can
    open what this process sends; None when shared memory is off here."""
    if not _on[0]:
        return None
    with _lock:
        if not _probe:
            _probe.append(_Slot(0))
    return [os.getpid(), _probe[0].fd, _probe[0].id]


def opens(ticket: list) -> bool:
    """Whether this process can open the probe ``ticket`` names."""
    try:
        pid, fd, sid = ticket
        _mapped(int(pid), int(fd), int(sid), 0)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def carried(tensors: list) -> tuple[list, bytes]:
    """The tensor table to send, each big CPU tensor in it replaced by an empty one, and
    the header that says where each replaced one is (b"" when none is)."""
    import torch  # noqa: PLC0415 - the core never gets here

    if not _on[0]:
        return tensors, b""
    half = FROM // 2  # (a message's small tensors: one attribute each, then nothing)
    big = [i for i, t in enumerate(tensors) if t.layout == torch.strided and t.nbytes >= half
           and t.device.type == "cpu" and not (t.is_quantized or t.is_conj() or t.is_neg()
                                               or t.requires_grad)  # (autograd sees those)
           and t.untyped_storage().nbytes() >= FROM]
    if not big:
        return tensors, b""
    storages = [t.untyped_storage().data_ptr() if t.layout == torch.strided and
                t.device.type != "meta" else None for t in tensors]
    out, entries = list(tensors), []
    with _lock:
        for i in big:
            t = tensors[i]
            if storages.count(storages[i]) > 1:
                continue  # sharing its storage with another one: TensorPipe keeps that
            offset, stride, nbytes, whole = _as_the_socket_sends(t)
            if nbytes < FROM:
                continue
            slot = _slot_for(nbytes)
            if slot is None:
                break  # the pool is full: the rest through the socket
            slot.map[8] = 1  # in flight until the receiver frees it
            at = t.untyped_storage().data_ptr() if whole else t.data_ptr()
            if nbytes < _ONE_THREAD and (whole or t.is_contiguous()):
                ctypes.memmove(slot.at, at, nbytes)  # (torch's copy_ wakes its threads)
            else:
                dst = torch.frombuffer(slot.map, dtype=torch.uint8, count=nbytes,
                                       offset=HEADER)
                if whole:  # its storage's bytes, as they are
                    dst.copy_(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()))
                else:
                    dst.view(t.dtype).as_strided(t.shape, stride).copy_(t.detach())
            entries.append([i, os.getpid(), slot.fd, slot.id, nbytes, str(t.dtype)[6:],
                            list(t.shape), stride, offset])
            out[i] = torch.empty(0, dtype=t.dtype)
            sent[0] += 1
    return out, (json.dumps(entries).encode() if entries else b"")


def _as_the_socket_sends(t) -> tuple[int, list[int], int, bool]:
    """``(offset, strides, bytes, whole storage?)`` of ``t`` as TensorPipe's agent sends it:
    a tensor using under half of a storage of 8 KB or more as its clone (strides kept if it
    fills its span, else contiguous), any other with its whole storage, offset and
    strides."""
    useful, sb = t.numel() * t.element_size(), t.untyped_storage().nbytes()
    if sb >= 8192 and sb >= 2 * useful:
        if _dense(t.shape, t.stride()):
            return 0, list(t.stride()), useful, False
        return 0, _contiguous(t.shape), useful, False
    return t.storage_offset(), list(t.stride()), sb, True


def _contiguous(shape) -> list[int]:
    out, n = [], 1
    for size in reversed(shape):
        out.append(n)
        n *= max(size, 1)
    return out[::-1]


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
    """``table`` with each tensor the header names put back: a tensor over the sender's
    slot, whose state is cleared when the last tensor over it is freed here."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    table = list(table)
    for i, pid, fd, sid, nbytes, dtype, shape, stride, offset in json.loads(header):
        m = _mapped(pid, fd, sid, nbytes)
        arr = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=HEADER)
        weakref.finalize(arr, _clear, m, os.getpid(), _forks[0]).atexit = False
        # a tensor of its own over the slot's storage (no view: as the socket gives it)
        table[i] = torch.empty(0, dtype=getattr(torch, dtype)).set_(
            torch.from_numpy(arr).untyped_storage(), offset, shape, stride)
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
        from ._forks import _gone  # noqa: PLC0415 - only when a slot is first mapped

        for ended in [k for k in _maps if _gone(k[0])]:
            del _maps[ended]  # a sender that ended: its slots are not asked for again
        _maps[(pid, fd)] = m
    return m


def _clear(m: mmap.mmap, pid: int, forks: int) -> None:
    if os.getpid() != pid or forks != _forks[0]:
        # a forked child letting go of its copy (the parent may still hold it), or a
        # tensor that was here when this process forked: a child holds it, over the same
        # pages; its slot is left in flight for good (the sender makes another)
        return
    try:
        m[8] = 0  # the sender may use this slot again
    except (ValueError, TypeError):  # closed at exit
        pass


def _forked() -> None:
    """In a forked child: the parent's slots are the parent's (its next message may be
    written into any of them), and what it mapped is for it to let go."""
    global _lock
    _lock = threading.Lock()  # (another thread may have held it at the fork)
    _slots.clear()
    _probe.clear()
    _maps.clear()
    sent[0] = 0


def _forking() -> None:
    _forks[0] += 1  # what is held now is shared with the child from now on


_forks = [0]
os.register_at_fork(before=_forking, after_in_child=_forked)
