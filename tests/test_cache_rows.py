"""Per-item keys in one native call: the same bytes as keyed BLAKE3 row by row."""

from __future__ import annotations

import shutil

import pytest
import torch
from blake3 import blake3

from somatize.store import _rows
from somatize.torch.cache._per_item import CONTEXT, item_keys, module_key

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler: rows are hashed one call each")


def one_by_one(mkey: str, x: torch.Tensor) -> list[bytes]:
    """The per-item key as docs/per-item.md defines it, one blake3 call per row."""
    key = blake3(bytes.fromhex(mkey) + f"{x.dtype}{list(x.shape[1:])}".encode(),
                 derive_key_context=CONTEXT).digest()
    raw = x.contiguous().reshape(x.shape[0], -1).view(torch.uint8).numpy().tobytes()
    rb = len(raw) // x.shape[0]
    return [blake3(raw[i * rb:(i + 1) * rb], key=key).digest(16) for i in range(x.shape[0])]


@needs_cc
def test_the_native_hasher_is_built_checked_and_used_here(tmp_path, monkeypatch):
    monkeypatch.setenv("SOMATIZE_NATIVE_DIR", str(tmp_path))
    fn = _rows._load()
    assert fn is not None
    assert [p.name[:5] for p in tmp_path.iterdir()] == ["rows-"]
    assert _rows.native() is not None  # the process's own, used by item_keys


@needs_cc
@pytest.mark.parametrize("shape,dtype", [
    ((256, 768), torch.float32), ((17, 3), torch.float32), ((33, 256), torch.float32),
    ((16, 1025), torch.uint8), ((5, 2, 4096), torch.float16), ((40, 512), torch.int64),
    ((1, 7), torch.int32), ((3, 0), torch.float32), ((19, 64), torch.bool),
])
def test_a_batchs_keys_in_one_call_are_keyed_blake3_row_by_row(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randint(0, 2, shape, generator=g) if dtype == torch.bool
         else torch.randint(0, 100, shape, generator=g)).to(dtype)
    mkey = module_key("Enc", "s" * 64, None)
    assert item_keys(mkey, x) == one_by_one(mkey, x)
    if x.dim() == 2 and x.shape[1] > 1:  # a view: its rows' bytes, not its storage's
        t = x.t().contiguous().t()
        assert item_keys(mkey, t) == one_by_one(mkey, x)


@needs_cc
@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_every_vector_width_gives_blake3s_bytes(tmp_path, lanes):
    # the width this machine's build picks (16 with AVX-512, 8 with AVX2, else 4), and the
    # others, built here too: each one checked as _load checks the one it uses
    import ctypes
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    so = tmp_path / f"rows{lanes}.so"
    subprocess.run([cc, *_rows.FLAGS, f"-DLANES={lanes}", "-o", str(so), str(_rows.SOURCE)],
                   check=True, capture_output=True, timeout=120)
    fn = ctypes.CDLL(str(so)).somatize_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p,
                   ctypes.c_void_p]
    assert _rows._agrees(fn)


def test_without_the_native_hasher_the_keys_are_the_same(monkeypatch):
    x = torch.rand(37, 300, generator=torch.Generator().manual_seed(5))
    mkey = module_key("Enc", None, "v2")
    fast = item_keys(mkey, x)
    monkeypatch.setattr(_rows, "_native", [None])
    assert item_keys(mkey, x) == fast == one_by_one(mkey, x)
    assert len(set(fast)) == 37


def test_a_row_and_its_neighbours_are_told_apart():
    x = torch.zeros(20, 1024)
    x[7, 1023] = 1.0  # the last byte of one row's only chunk
    keys = item_keys(module_key("Enc", None, None), x)
    assert keys[7] != keys[6] and keys[6] == keys[8] and len(set(keys)) == 2


@needs_cc
@pytest.mark.parametrize("threads", [1, 3])  # 3: a helper thread whatever the load
def test_one_thread_or_two_give_blake3s_bytes(threads):
    lib = _rows._libs[-1] if _rows.native() is not None else None
    assert lib is not None
    x = torch.rand(1500, 768, generator=torch.Generator().manual_seed(7))  # 4.6 MB: shared
    mkey = module_key("Enc", "t" * 64, None)
    lib.somatize_set_threads(threads, 0)
    try:
        assert item_keys(mkey, x) == one_by_one(mkey, x)
        assert _rows._agrees(_rows.native())
    finally:
        lib.somatize_set_threads(2, 0)


@needs_cc
@pytest.mark.parametrize("n", [1, 7, 256, 2200])  # 2200 rows of 2 KB: shared
def test_served_rows_gathered_natively_are_index_selects(n):
    from array import array
    from types import SimpleNamespace

    from somatize.torch.cache._gather import gather

    g = torch.Generator().manual_seed(n)
    arena = torch.rand(2400, 512, generator=g)
    codes = array("q", torch.randint(0, 2400, (n,), generator=g).tolist())
    rows = SimpleNamespace(codes=codes, arena=bytearray(arena.numpy().tobytes()), row=(512,))
    lib = _rows._libs[-1] if _rows.native() is not None else None
    lib.somatize_set_threads(3, 0)
    try:
        got = torch.empty(n, 512)
        gather(got, rows, torch.float32)
    finally:
        lib.somatize_set_threads(2, 0)
    assert torch.equal(got, arena[torch.tensor(codes.tolist())])
    out_of_range = SimpleNamespace(codes=array("q", [0, 2400]), arena=rows.arena, row=(512,))
    with pytest.raises(IndexError):  # refused natively, then by index_select
        gather(torch.empty(2, 512), out_of_range, torch.float32)


@needs_cc
@pytest.mark.parametrize("n,threads", [(1, 1), (7, 3), (256, 1), (256, 3), (2200, 3)])
def test_a_batch_served_in_one_call_is_its_keys_and_its_arena_rows(n, threads):
    """``somatize_serve``: the keys ``item_keys`` gives, and every row found in the table
    copied from the arena in the batch's order (one thread or two); one key not there:
    fewer found, the keys all the same."""
    from somatize.store._served import Served
    from somatize.torch.cache._item_keys import rows_key

    g = torch.Generator().manual_seed(n)
    x, arena = torch.rand(n, 768, generator=g), torch.rand(3000, 512, generator=g)
    mkey = module_key("Enc", "s" * 64, None)
    want = one_by_one(mkey, x)
    codes = torch.randint(0, 3000, (n,), generator=g)
    served = Served()
    served.add(want, codes.tolist())
    serve, lib = _rows.serve_function(), _rows._libs[-1]
    key = rows_key(mkey, x.dtype, (768,))

    def call(table: tuple) -> tuple[int, list[bytes], torch.Tensor]:
        keys, out = _rows.key_buffer(n)(), torch.full((n, 512), -1.0)
        found = serve(x.data_ptr(), n, 768 * 4, key, keys, table[0] or None, table[1],
                      arena.data_ptr(), 3000, out.data_ptr(), 512 * 4)
        return found, _rows.split_keys(keys, n), out

    lib.somatize_set_threads(threads, 1)  # the helper asked from one byte on
    try:
        found, keys, out = call(served.table())
        assert found == n and keys == want and torch.equal(out, arena[codes])
        assert call((0, 0))[:2] == (0, want)  # no table yet: the keys alone
        fewer = Served()
        fewer.add(want[1:], codes[1:].tolist())
        found, keys, out = call(fewer.table())
        assert found == (n - 1 if want[0] not in want[1:] else n) and keys == want
        assert torch.equal(out[1:], arena[codes[1:]])
        short = Served()
        short.add(want, [2999 + 1] + codes[1:].tolist())  # a row past the arena's: not found
        assert call(short.table())[0] == n - 1
    finally:
        lib.somatize_set_threads(2, 0)


@needs_cc
def test_threads_hashing_at_once_each_get_their_own_rows_keys():
    """The native helper is one per process: calls from several threads at once (ctypes
    lets go of the GIL) each get their own batch's keys, the helper asked always."""
    import threading

    lib = _rows._libs[-1] if _rows.native() is not None else None
    mkey = module_key("Enc", "t" * 64, None)
    xs = [torch.rand(600, 768, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    want = [one_by_one(mkey, x) for x in xs]
    got: dict[int, list] = {}
    lib.somatize_set_threads(3, 1)
    try:
        def run(i: int) -> None:
            got[i] = [item_keys(mkey, xs[i]) for _ in range(25)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        lib.somatize_set_threads(2, 0)
    assert all(got[i] == [want[i]] * 25 for i in range(4))
