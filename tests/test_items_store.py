"""Per-item memory on disk (store layer, no model): packs and the index, read back right,
and anything cut, flipped or crafted read as a miss, never as a wrong row."""

import os
import struct
import time
from pathlib import Path

from items_writer import MODULE, ROW, key_of, missing, row_of, write

from somatize.store import _items
from somatize.store._index import SMALL, Index, Loc, Segment, encode
from somatize.store._items import Items
from somatize.store._items_care import gc, spaces, verify
from somatize.store._packs import row_digest


def space_of(path):
    return Items(path).space(MODULE, {"module": "writer"})


def test_rows_kept_together_are_read_back_one_by_one_in_the_order_asked(tmp_path):
    write(tmp_path, 0, 100, 100, seed=1)
    sp = space_of(tmp_path)
    assert len(sp.pack_names()) == 1  # one write, one pack: never a file per item
    ids = [57, 3, 999, 3, 12]
    keys = [key_of(i) for i in ids]
    locs = sp.lookup(keys)
    assert [loc is None for loc in locs] == [False, False, True, False, False]
    rows = sp.read(keys, locs)
    assert rows.dtype == "F32" and rows.row == ROW and rows.ok == [True, True, False, True, True]
    for n, i in enumerate(ids):
        if rows.ok[n]:
            assert rows.slot(n) == row_of(i)


def test_a_second_reader_finds_what_a_first_wrote_after_it_opened(tmp_path):
    reader = space_of(tmp_path)
    assert reader.lookup([key_of(1)]) == [None]
    write(tmp_path, 0, 10, 10, seed=0)
    assert reader.lookup([key_of(1)])[0] is not None  # new segments are seen at each lookup


def test_segments_are_compacted_and_every_item_stays_readable(tmp_path):
    write(tmp_path, 0, 400, 10, seed=2)  # 40 writes
    sp = space_of(tmp_path)
    segs = [n for n in os.listdir(sp.folder / "index") if n.endswith(".seg")]
    assert len(segs) < 16
    assert missing(tmp_path, 0, 400) == []
    assert verify(Items(tmp_path)) == []
    [use] = spaces(Items(tmp_path))
    assert use.items == 400 and use.packs == 40 and use.module == "writer"


def test_a_big_segment_is_found_by_its_dict_and_through_its_fan_out():
    recs = {key_of(i): Loc("0" * 32, i, b"d" * 16) for i in range(SMALL + 5)}
    seg = Segment(b"".join(encode(recs)))
    assert seg.bits == 14
    for i in (0, 17, SMALL + 4):
        assert seg.find(key_of(i)) == seg.search(key_of(i)) == Loc("0" * 32, i, b"d" * 16)
    assert seg.find(key_of(-1)) is None and seg.search(key_of(-1)) is None


def test_a_flipped_bit_in_a_pack_is_a_miss_and_verify_names_the_pack(tmp_path):
    write(tmp_path, 0, 20, 20, seed=3)
    sp = space_of(tmp_path)
    [pack] = sp.pack_names()
    path = sp.folder / "packs" / f"{pack}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # the last row's last byte
    path.write_bytes(raw)
    assert missing(tmp_path, 0, 20) == list(range(20))  # the pack is checked whole
    problems = verify(Items(tmp_path))
    assert len(problems) == 2 and all(str(path) in p for p in problems)
    assert "do not match its digest" in problems[0] and "row 19" in problems[1]


def test_a_pack_changed_after_a_reader_checked_it_is_a_miss_for_a_new_reader(tmp_path):
    write(tmp_path, 0, 20, 20, seed=3)
    sp = space_of(tmp_path)
    keys = [key_of(i) for i in range(20)]
    assert all(sp.read(keys, sp.lookup(keys)).ok)  # checked, and its rows held
    path = sp.folder / "packs" / f"{sp.pack_names()[0]}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 8
    tmp = path.with_name("x")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    got = sp.read(keys, sp.lookup(keys))  # the rows it checked, still right
    assert all(got.ok) and [got.slot(i) for i in range(20)] == [row_of(i) for i in range(20)]
    assert missing(tmp_path, 0, 20) == list(range(20))  # a new reader checks the new file


def test_a_crafted_pack_header_pointing_past_its_file_is_a_miss(tmp_path):
    write(tmp_path, 0, 20, 20, seed=4)
    sp = space_of(tmp_path)
    [pack] = sp.pack_names()
    path = sp.folder / "packs" / f"{pack}.safetensors"
    raw = path.read_bytes()
    hlen = struct.unpack("<Q", raw[:8])[0]
    head = raw[8:8 + hlen].replace(b'"shape":[20,8],"data_offsets":[320,960]',
                                   b'"shape":[90,8],"data_offsets":[320,3200]')
    assert head != raw[8:8 + hlen]
    path.write_bytes(raw[:8] + head + raw[8 + hlen:])
    assert missing(tmp_path, 0, 20) == list(range(20))
    assert any("tensors end at 3200, the data is" in p for p in verify(Items(tmp_path)))


def test_a_crafted_index_never_serves_another_items_row(tmp_path):
    write(tmp_path, 0, 20, 20, seed=5)
    sp = space_of(tmp_path)
    good = sp.index.records()
    # a well-formed segment that sends item 0 to item 1's row, and item 2 past the pack
    folder = sp.folder / "index"
    for n in os.listdir(folder):
        os.unlink(folder / n)
    crafted = dict(good)
    crafted[key_of(0)] = good[key_of(1)]
    crafted[key_of(2)] = good[key_of(2)]._replace(row=10_000)
    (folder / f"{'c' * 32}.seg").write_bytes(b"".join(encode(crafted)))
    assert missing(tmp_path, 0, 20) == [0, 2]  # read as misses, never as wrong rows
    # a cut segment is skipped whole
    raw = (folder / f"{'c' * 32}.seg").read_bytes()
    (folder / f"{'c' * 32}.seg").write_bytes(raw[:-7])
    assert missing(tmp_path, 0, 20) == list(range(20))
    assert any("do not match their digest" in p or "size" in p
               for p in verify(Items(tmp_path)))


def test_a_row_digest_binds_the_row_to_its_key_dtype_and_shape():
    row = b"x" * 32
    d = row_digest(key_of(0), "F32", (8,), row)
    assert d != row_digest(key_of(1), "F32", (8,), row)
    assert d != row_digest(key_of(0), "I32", (8,), row)
    assert d != row_digest(key_of(0), "F32", (4, 2), row)


def test_gc_keeps_a_pack_while_one_of_its_items_is_named_and_drop_removes_one_module(tmp_path):
    write(tmp_path, 0, 20, 20, seed=6)
    other = Items(tmp_path).space("cd" * 32, {"module": "other"})
    other.put([key_of(1)], "F32", ROW, row_of(1))
    sp = space_of(tmp_path)
    [pack] = sp.pack_names()
    # an index that names one row of the pack, and an orphan pack (a killed writer's)
    keep = {key_of(5): sp.index.records()[key_of(5)]}
    folder = sp.folder / "index"
    for n in os.listdir(folder):
        os.unlink(folder / n)
    Index(str(tmp_path), f"items/{MODULE}/index").add(keep)
    sp2 = space_of(tmp_path)
    sp2.put([key_of(7)], "F32", ROW, row_of(7))
    orphan = [p for p in sp2.pack_names() if p != pack][0]
    for n in os.listdir(folder):
        if Segment((folder / n).read_bytes()).packs == [orphan]:
            os.unlink(folder / n)
    size = (sp.folder / "packs" / f"{orphan}.safetensors").stat().st_size
    assert gc(Items(tmp_path), grace=3600) == (0, 0)  # too young: a writer may be naming it
    assert gc(Items(tmp_path), grace=0) == (1, size)
    assert sp2.pack_names() == [pack]
    assert missing(tmp_path, 0, 20) == [i for i in range(20) if i != 5]
    assert Items(tmp_path).drop(MODULE)
    assert Items(tmp_path).keys() == ["cd" * 32]
    assert Items(tmp_path).space("cd" * 32).lookup([key_of(1)])[0] is not None


def test_a_store_that_cannot_be_written_is_no_crash(tmp_path):
    Path(tmp_path / "items").write_text("a file where the folder should be")
    sp = space_of(tmp_path)
    assert sp.put([key_of(0)], "F32", ROW, row_of(0)) is False
    assert sp.lookup([key_of(0)]) == [None]


def test_the_store_command_lists_measures_checks_cleans_and_drops_packs(tmp_path, capsys):
    from somatize._store_cli import main

    write(tmp_path, 0, 30, 10, seed=7)
    Items(tmp_path).space("cd" * 32, {"module": "other"}).put([key_of(1)], "F32", ROW, row_of(1))
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"items/{MODULE}\t30 items in 3 packs" in out and "module=writer" in out
    assert main(["du", str(tmp_path)]) == 0
    assert "per item: 2 modules, 31 items in 4 packs" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 0
    sp = space_of(tmp_path)
    path = sp.folder / "packs" / f"{sp.pack_names()[0]}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 4
    path.write_bytes(raw)
    assert main(["verify", str(tmp_path)]) == 1
    assert str(path) in capsys.readouterr().err
    assert main(["gc", str(tmp_path)]) == 0  # nothing unnamed: every pack kept
    assert len(sp.pack_names()) == 3
    assert main(["drop", str(tmp_path), "writer"]) == 0
    assert Items(tmp_path).keys() == ["cd" * 32]
    assert main(["drop", str(tmp_path), "writer"]) == 1


def test_per_item_files_are_made_private_or_shared_and_never_through_a_link(tmp_path):
    import stat

    write(tmp_path / "private", 0, 40, 20, seed=8)
    shared = Items(tmp_path / "shared", shared=True).space(MODULE, {"module": "writer"})
    assert shared.put([key_of(1)], "F32", ROW, row_of(1))
    for name, (dirs, files) in (("private", (0o700, 0o600)), ("shared", (0o2770, 0o660))):
        made = list((tmp_path / name / "items").rglob("*"))
        assert {p.suffix for p in made if p.is_file()} >= {".safetensors", ".seg", ".json"}
        for p in made:
            assert stat.S_IMODE(p.stat().st_mode) == (dirs if p.is_dir() else files), (name, p)
    # a link below the root (the module's packs folder pointed elsewhere): nothing kept there
    outside = tmp_path / "outside"
    outside.mkdir()
    sp = space_of(tmp_path / "private")
    packs = sp.folder / "packs"
    for p in packs.iterdir():
        p.unlink()
    packs.rmdir()
    packs.symlink_to(outside)
    assert not sp.put([key_of(99)], "F32", ROW, row_of(99))  # said once; the run goes on
    assert list(outside.iterdir()) == []


def test_a_reader_that_lists_the_index_while_another_compacts_it_finds_every_record(tmp_path):
    # the interleaving forced: the reader lists the segments, then another process's
    # compaction names the merged segment and removes the listed ones before the reader
    # reads them. The records are in the merged one, and the reader finds them there.
    rel = f"items/{MODULE}/index"
    locs = {key_of(i): Loc("0" * 32, i, bytes(16)) for i in range(8)}
    for k, loc in locs.items():  # 8 segments: fewer than a compaction waits for
        Index(str(tmp_path), rel).add({k: loc})
    other = Index(str(tmp_path), rel)
    other.refresh()

    class Racing(Index):
        raced = False

        def _list(self):
            names = super()._list()
            if not self.raced:
                self.raced = True
                other.compact(list(other.segments))
            return names

    reader = Racing(str(tmp_path), rel)
    assert reader.lookup(list(locs)) == list(locs.values())
    assert reader.raced and len(os.listdir(tmp_path / rel)) == 1  # it did compact


def test_after_damage_and_a_second_copy_gc_verify_and_lookups_agree_on_the_live_copy(tmp_path):
    write(tmp_path, 0, 20, 20, seed=3)
    sp = space_of(tmp_path)
    [bad] = sp.pack_names()
    path = sp.folder / "packs" / f"{bad}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    [seg] = os.listdir(sp.folder / "index")
    # the damaged copy's segment named so it sorts first (a name from before stamps)
    os.rename(sp.folder / "index" / seg, sp.folder / "index" / ("0" * 32 + ".seg"))
    assert missing(tmp_path, 0, 20) == list(range(20))
    again = Items(tmp_path).space(MODULE, {"module": "writer"})  # the items kept again
    assert again.put([key_of(i) for i in range(20)], "F32", ROW,
                     b"".join(row_of(i) for i in range(20)))
    [good] = [p for p in again.pack_names() if p != bad]
    assert missing(tmp_path, 0, 20) == []  # the newer record counts
    problems = verify(Items(tmp_path))
    assert len(problems) == 1 and str(path) in problems[0] and "older copy" in problems[0]
    gc(Items(tmp_path), grace=0)
    assert good in space_of(tmp_path).pack_names()  # never the live copy
    assert missing(tmp_path, 0, 20) == []
    index = Index(str(tmp_path), f"items/{MODULE}/index")
    index.refresh()
    index.compact(sorted(os.listdir(sp.folder / "index")))  # the older record merged away...
    gc(Items(tmp_path), grace=0)
    assert space_of(tmp_path).pack_names() == [good]  # ...and then its pack
    assert missing(tmp_path, 0, 20) == [] and verify(Items(tmp_path)) == []


def test_items_served_before_are_found_in_one_call_as_the_dict_finds_them(tmp_path, monkeypatch):
    from somatize.store import _rows
    from somatize.store._served import Served

    write(tmp_path, 0, 3000, 3000, seed=2)
    sp = space_of(tmp_path)
    ids = list(range(0, 3000, 7))
    keys = [key_of(i) for i in ids]
    assert sp.served(keys) is None  # nothing served yet
    rows = sp.read(keys, sp.lookup(keys))
    assert all(rows.ok)
    got = sp.served(keys[::-1])  # every one read from the arena: answered at once
    assert got is not None and got.ok == [True] * len(keys)
    assert [bytes(memoryview(got.arena)[c * 4 * ROW[0]:(c + 1) * 4 * ROW[0]])
            for c in got.codes] == [row_of(i) for i in ids[::-1]]
    assert sp.served(keys + [key_of(1)]) is None  # one not served: asked of the index
    write(tmp_path, 5000, 5010, 10, seed=3)  # a segment comes: what was served is forgotten
    time.sleep(_items._SERVED_LOOK / 1e9)  # once the index is looked at again (50 ms on)
    assert sp.served(keys) is None
    # the table (where the native library is) and the dict alone answer alike, growing
    both = [Served()]
    assert (both[0]._fns is not None) == (_rows.native() is not None)
    monkeypatch.setattr(_rows, "_native", [None])
    both.append(Served())
    assert both[1]._fns is None
    many = [key_of(i) for i in range(5000)]
    for s in both:
        for at in range(0, 5000, 250):
            s.add(many[at:at + 250], list(range(at, at + 250)))
        s.add(many[:3], [7, 8, 9])  # a key served again, elsewhere: the last row counts
    for s in both:
        assert list(s.codes(many[:5])) == [7, 8, 9, 3, 4]
        assert list(s.codes(many[4990:])) == list(range(4990, 5000))
        assert s.codes(many[:4] + [key_of(6000)]) is None and s.codes([]) is None
        s.clear()
        assert s.codes(many[:1]) is None and len(s) == 0
