"""somatize's modules compiled once a process, where Python keeps no bytecode
(``PYTHONDONTWRITEBYTECODE=1``, common in containers, with an editable install: no
``.pyc`` beside the sources). An embedded worker's fork server, forked from the fit,
imports somatize's modules afresh (never the fit's module objects); compiling them again
from source was most of its start (0.2-1 s of a core here, against 0.05 s with bytecode).
The code objects are kept in memory on the import finder below and a fork inherits them;
nothing is written anywhere.

    from . import _compiled   # somatize/__init__.py, first: it installs itself

A source changed on disk since (its mtime or size) is compiled again.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from types import CodeType


class _Loader(importlib.machinery.SourceFileLoader):
    """A source loader answering ``get_code`` from the finder's code objects."""

    def __init__(self, name: str, path: str, codes: dict | None = None):
        super().__init__(name, path)  # (made again by its two arguments: its own codes)
        self.codes = {} if codes is None else codes

    def get_code(self, fullname: str) -> CodeType | None:
        path = self.get_filename(fullname)
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
        kept = self.codes.get(path)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        code = super().get_code(fullname)
        if code is not None:
            self.codes[path] = (stamp, code)
        return code


class _Finder:
    """On ``sys.meta_path``: somatize's submodules, loaded by ``_Loader``."""

    def __init__(self):
        self.somatize_codes: dict[str, tuple[tuple[int, int], CodeType]] = {}

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith("somatize.") or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if type(loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _Loader(loader.name, loader.path, self.somatize_codes)
        return spec


def install() -> None:
    """Keep somatize's code objects where no bytecode is written (once a process: the
    finder of a first import stays, with its code objects, when somatize is imported
    again)."""
    if not sys.dont_write_bytecode:
        return
    if any(getattr(f, "somatize_codes", None) is not None for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


install()
