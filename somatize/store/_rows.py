"""The keys of a batch's rows in one call: keyed BLAKE3 of each row, 16 rows side by side.

    keys = row_keys(key, raw, n, x.data_ptr())   # [BLAKE3-keyed(key, row i)[:16], ...]

The same bytes as ``blake3(row, key=key).digest(16)`` row by row, which is what runs
where no native hasher can be had. One call per row fills 3 of the 16 vector lanes
BLAKE3 has here (a row of 3 KB is 3 chunks), so it costs 5x the one call that hashes the
whole batch; ``_rows.c`` hashes 16 rows at once, one per lane. It is compiled once per
machine with the C compiler found (``cc``, or ``$CC``) into ``$SOMATIZE_NATIVE_DIR``
(default ``~/.cache/somatize``), loaded with ctypes, and used only after it gave the
blake3 package's bytes on rows of many lengths. ``SOMATIZE_NATIVE=0`` turns it off. A
batch of 512 KB or more is hashed (and its served rows gathered: ``gather``, ``serve``) on
two threads (one kept helper) while the load average leaves a CPU free;
``SOMATIZE_NATIVE_THREADS=1`` keeps one, ``SOMATIZE_NATIVE_HELP_FROM=<bytes>`` moves the
threshold.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import random
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

from blake3 import blake3

log = logging.getLogger("somatize.store")
SOURCE = Path(__file__).with_name("_rows.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-pthread"]
_lock = threading.Lock()
_native: list = []  # [] not tried yet; [None] none to be had; [function]
_libs: list = []  # the library it came from


def row_keys(key: bytes, raw: memoryview | int, n: int,
             address: int | None = None) -> list[bytes]:
    """One 16-byte key per row of ``raw`` (``n`` rows of one length, contiguous), keyed by
    ``key``; ``address``: where its bytes start (a tensor's ``data_ptr()``), which the native
    hasher reads (without it, or without the hasher: one blake3 call a row). With an
    address, ``raw`` may be just the bytes' count (where ``native()`` said it is there)."""
    size = raw if isinstance(raw, int) else raw.nbytes
    rb = size // n if n else 0
    if rb == 0:  # rows of no bytes: all the same
        return [blake3(b"", key=key).digest(16)] * n
    fn = native() if address else None
    if fn is None:
        return [blake3(raw[i * rb:(i + 1) * rb], key=key).digest(16) for i in range(n)]
    out = key_buffer(n)()
    fn(address, n, rb, key, out)
    return split_keys(out, n)


def split_keys(out: ctypes.Array, n: int) -> list[bytes]:
    """The ``n`` keys of 16 bytes a native call wrote into ``out``, as bytes objects (in
    one call)."""
    return list(_split(n).unpack_from(out))


@functools.lru_cache(maxsize=64)
def _split(n: int) -> struct.Struct:
    return struct.Struct("16s" * n)


@functools.lru_cache(maxsize=64)
def key_buffer(n: int) -> type:
    """The ctypes type of ``n`` keys' bytes (made once: making one costs more than a hash)."""
    return ctypes.c_char * (16 * n)


def native():
    """The native hasher, compiled and checked on first use; None where it cannot be had."""
    if not _native:
        with _lock:
            if not _native:
                _native.append(_load())
    return _native[0]


def table_functions():
    """``(put, get)`` of the served items' table (``_served``), from the library the native
    hasher came from; None where there is none."""
    fn = native()
    if fn is None:
        return None
    lib = _libs[-1]
    put, get = lib.somatize_table_put, lib.somatize_table_get
    put.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_void_p,
                    ctypes.c_uint64]
    put.restype = None
    get.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_uint64,
                    ctypes.c_void_p]
    get.restype = ctypes.c_uint64
    return put, get


def gather_function():
    """``gather(dst, src, src_rows, rows, n, rb) -> 0`` (1: a row out of range, nothing
    copied): rows of ``rb`` bytes copied from ``src`` to ``dst`` in the order of the int64
    array ``rows``; None where the native library is not there."""
    if native() is None:
        return None
    fn = _libs[-1].somatize_gather
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                   ctypes.c_uint64, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def serve_function():
    """``serve(data, n, rb, key, keys, table, mask, arena, arena_rows, dst, orb) -> found``:
    a batch's keys (as ``row_keys``, into ``keys``) and, where every one is in the served
    table, their arena rows copied into ``dst`` (``found == n``), in one call; None where
    the native library is not there."""
    if native() is None:
        return None
    fn = _libs[-1].somatize_serve
    p, u = ctypes.c_void_p, ctypes.c_uint64
    fn.argtypes = [p, u, u, ctypes.c_char_p, p, p, u, p, u, p, u]
    fn.restype = u
    return fn


def _load():
    if os.environ.get("SOMATIZE_NATIVE", "1") == "0":
        return None
    try:
        path = _built()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
        fn = lib.somatize_rows
    except OSError as e:
        log.info("per-item keys: the native row hasher cannot be loaded (%s); rows are "
                 "hashed one call each", e)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p,
                   ctypes.c_void_p]
    fn.restype = None
    if not _agrees(fn):
        log.warning("per-item keys: the native row hasher built in %s does not give BLAKE3's "
                    "bytes on this machine; it is not used (rows are hashed one call each). "
                    "Remove the file to build it again", path)
        return None
    lib.somatize_set_threads.argtypes = [ctypes.c_int, ctypes.c_uint64]
    lib.somatize_set_threads(int(os.environ.get("SOMATIZE_NATIVE_THREADS", "2") or 2),
                             int(os.environ.get("SOMATIZE_NATIVE_HELP_FROM", "0") or 0))
    _libs.append(lib)
    return fn


def _built() -> Path | None:
    """The compiled hasher for this source, compiler and machine (built if missing)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("per-item keys: no C compiler (cc, or $CC) to build the native row hasher; "
                 "rows are hashed one call each")
        return None
    # -march=native: the file is only for a machine with this CPU (a shared home sees many)
    name = blake3(b"\0".join([SOURCE.read_bytes(), cc.encode(), " ".join(FLAGS).encode(),
                              platform.machine().encode(), _cpu().encode()])).hexdigest()[:24]
    folder = Path(os.environ.get("SOMATIZE_NATIVE_DIR") or Path.home() / ".cache" / "somatize")
    path = folder / f"rows-{name}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-rows-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            log.info("per-item keys: %s could not build the native row hasher (%s); rows are "
                     "hashed one call each", cc, done.stderr.strip()[-300:])
            return None
        os.replace(tmp, path)  # whole or not there, for processes building it at once
    except (OSError, subprocess.SubprocessError) as e:
        log.info("per-item keys: the native row hasher could not be built (%s)", e)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _agrees(fn) -> bool:
    """Whether ``fn`` gives the blake3 package's keyed hashes, on rows that cover one and
    many blocks and chunks, partial ones, and a count that leaves lanes unfilled."""
    key = blake3(b"check", derive_key_context="somatize native row hasher check").digest()
    rng = random.Random(0)
    for rb in (1, 63, 64, 65, 1023, 1024, 1025, 2048, 3072, 4097, 9000):
        data = rng.randbytes(19 * rb)
        buf = ctypes.create_string_buffer(data, len(data))
        out = ctypes.create_string_buffer(16 * 19)
        fn(ctypes.addressof(buf), 19, rb, key, out)
        raw = out.raw
        if any(raw[16 * i:16 * i + 16] != blake3(data[i * rb:(i + 1) * rb], key=key).digest(16)
               for i in range(19)):
            return False
    return True
