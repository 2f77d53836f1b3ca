"""Every code block in README.md and docs/ runs as written, or says it is a part.

A fenced block is one of:
- a complete ```python block: run (in one process for all of them, each in its own
  namespace and empty working directory, with a 120 s budget), and it must not raise;
- the expected output of the python block before it, marked ``<!-- output -->`` on the
  line above: each of its lines must be printed, in order (``...`` stands for anything);
- a part, marked ``<!-- fragment -->`` on the line above (a command for a shell or
  another machine, a piece of a longer script): not run;
- marked ``<!-- run by tests/test_x.py -->``: run by that test, which must read it.
Any other block fails here: say what it is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```([\w-]*)\n(.*?)^\1```\n", re.S | re.M)
MARK = re.compile(r"<!--\s*(fragment|output|run by [\w/.]+)\s*-->\s*\n\s*\Z")


def blocks(text: str, page: str) -> list[dict]:
    """The fenced blocks of a page: where each starts, its language, code and mark."""
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()]
        mark = MARK.search(before)
        found.append({"page": page, "line": before.count("\n") + 1, "lang": m.group(2),
                      "code": textwrap.dedent(m.group(3)), "mark": mark.group(1) if mark
                      else None})
    return found


def runnable(found: list[dict]) -> list[dict]:
    """The complete python blocks, each with the output block that follows it, if any."""
    run = []
    for i, b in enumerate(found):
        if b["lang"] == "python" and b["mark"] is None:
            nxt = found[i + 1] if i + 1 < len(found) else None
            b = {**b, "expect": nxt["code"] if nxt and nxt["mark"] == "output" else None}
            run.append(b)
    return run


def unsaid(found: list[dict]) -> list[str]:
    """The blocks that are neither run, nor an output, nor marked a part."""
    return [f"{b['page']}:{b['line']} ({b['lang'] or 'no language'})" for b in found
            if b["mark"] is None and b["lang"] != "python"]


def missing(expect: str, out: str) -> str | None:
    """The first expected line not printed (in order), or None."""
    pos = 0
    for line in expect.strip("\n").splitlines():
        pat = ".*?".join(re.escape(part) for part in line.strip().split("..."))
        m = re.compile(pat).search(out, pos)
        if m is None:
            return line
        pos = m.end()
    return None


RUNNER = r"""
import contextlib, io, json, os, sys, tempfile, time, traceback
blocks = json.load(open(sys.argv[1]))
results = []
for b in blocks:
    d = tempfile.mkdtemp(prefix="docblock-")
    os.chdir(d)
    out = io.StringIO()
    t = time.monotonic()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(b["code"], f"{b['page']}:{b['line']}", "exec"),
                 {"__name__": "__docs__"})
        error = None
    except BaseException:
        error = traceback.format_exc()
    results.append({"out": out.getvalue(), "error": error, "s": time.monotonic() - t})
json.dump(results, open(sys.argv[2], "w"))
"""


def run_blocks(run: list[dict], tmp: Path, timeout: float) -> list[dict]:
    """Run the blocks in one fresh process (RPC starts once a process); their results."""
    (tmp / "blocks.json").write_text(json.dumps(run))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", RUNNER, str(tmp / "blocks.json"),
                           str(tmp / "results.json")], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / "results.json").read_text())


FOUND = [b for p in PAGES for b in blocks(p.read_text(), p.relative_to(ROOT).as_posix())]
RUN = runnable(FOUND)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_blocks(RUN, tmp_path_factory.mktemp("docs"), timeout=600)


def test_every_block_is_run_or_says_what_it_is():
    assert not unsaid(FOUND), unsaid(FOUND)
    for b in FOUND:
        if b["mark"] and b["mark"].startswith("run by "):
            test = ROOT / b["mark"][len("run by "):]
            assert test.is_file() and Path(b["page"]).name in test.read_text(), b["mark"]
    assert len(RUN) >= 3, [f"{b['page']}:{b['line']}" for b in RUN]


@pytest.mark.parametrize("i", range(len(RUN)), ids=[f"{b['page']}:{b['line']}" for b in RUN])
def test_a_complete_block_runs_as_written_and_prints_what_it_says(results, i):
    got, b = results[i], RUN[i]
    assert got["error"] is None, f"{b['page']}:{b['line']} raised:\n{got['error']}"
    if b["expect"] is not None:
        line = missing(b["expect"], got["out"])
        assert line is None, f"{b['page']}:{b['line']} did not print {line!r}:\n{got['out']}"


def test_a_block_that_breaks_or_prints_otherwise_fails_here(tmp_path):
    page = ("```python\nprint('fine', 1 + 1)\n```\n<!-- output -->\n```\nfine 2\n```\n"
            "```python\nprint(undefined_name)\n```\n<!-- fragment -->\n```bash\nrm -rf /\n```\n"
            "```bash\nls\n```\n")
    found = blocks(page, "page.md")
    assert unsaid(found) == ["page.md:15 (bash)"]
    run = runnable(found)
    assert [b["expect"] for b in run] == ["fine 2\n", None]
    ok, broken = run_blocks(run, tmp_path, timeout=60)
    assert ok["error"] is None and missing(run[0]["expect"], ok["out"]) is None
    assert missing("fine 3", ok["out"]) == "fine 3"
    assert "NameError" in broken["error"]
