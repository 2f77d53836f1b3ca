"""Per-item memory across processes: writers killed with SIGKILL at random points never
leave a wrong row, and two writers of overlapping items both end with every item."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from items_writer import missing

from somatize.store._items import Items
from somatize.store._items_care import gc, verify

WRITER = str(Path(__file__).with_name("items_writer.py"))


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WRITER, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_writer_killed_at_random_points_never_leaves_a_wrong_row(tmp_path):
    rng = random.Random(19)
    # ~20 rounds, each killed somewhere in its writes (first writes of a round, its
    # compactions, its last writes); reading after each checks every row it finds
    for r in range(20):
        p = start("write", tmp_path, 0, 3000, 7, r)
        assert p.stdout.readline() == b"writing\n"  # its imports done, however loaded the machine
        time.sleep(0.05 + rng.random() * 0.6)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        missing(tmp_path, 0, 3000)  # asserts each row read is the item's own
        assert verify(Items(tmp_path)) == []
    left = missing(tmp_path, 0, 3000)
    assert len(left) < 3000  # the rounds kept something
    gc(Items(tmp_path), grace=0)
    assert verify(Items(tmp_path)) == []
    assert missing(tmp_path, 0, 3000) == left  # gc removed only what no segment names
    p = start("write", tmp_path, 0, 3000, 50, 99)  # a whole writer finishes the job
    p.communicate(timeout=120)
    assert p.returncode == 0 and missing(tmp_path, 0, 3000) == []


def test_two_writers_of_overlapping_items_at_once_both_end_with_every_item(tmp_path):
    a = start("write", tmp_path, 0, 1500, 20, 1)
    b = start("write", tmp_path, 500, 2000, 20, 2)
    for p in (a, b):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()  # each checked all of its items at the end
    assert missing(tmp_path, 0, 2000) == []
    assert verify(Items(tmp_path)) == []
