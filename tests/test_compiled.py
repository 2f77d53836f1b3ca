"""Where no bytecode is written (PYTHONDONTWRITEBYTECODE=1, an editable install),
somatize's modules are compiled once a process: imported again (as the embedded
workers' fork server does, afresh), they are not compiled again; a source changed on
disk is (`somatize/_compiled.py`)."""

import importlib
import sys
from importlib.machinery import SourceFileLoader

import pytest

from somatize import _compiled


@pytest.fixture
def compiling(tmp_path, monkeypatch):
    """Every module compiled from source while the test runs (no .pyc to read), the
    paths it compiled; somatize's modules as they were, after."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "no-bytecode"))
    compiled = []
    real = SourceFileLoader.source_to_code

    def counted(self, data, path, *args, **kwargs):
        compiled.append(str(path))
        return real(self, data, path, *args, **kwargs)

    monkeypatch.setattr(SourceFileLoader, "source_to_code", counted)
    saved = {n: m for n, m in sys.modules.items() if n == "somatize" or n.startswith("somatize.")}
    meta = list(sys.meta_path)
    finder = _compiled._Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield compiled
    finally:
        sys.meta_path[:] = meta
        for n in [n for n in sys.modules if n == "somatize" or n.startswith("somatize.")]:
            del sys.modules[n]
        sys.modules.update(saved)


def fresh_import(compiled, name="somatize"):
    for n in [n for n in sys.modules if n == "somatize" or n.startswith("somatize.")]:
        del sys.modules[n]
    compiled.clear()
    importlib.import_module(name)
    return sorted(p.rpartition("/somatize/")[2] for p in compiled if "/somatize/" in p)


def test_imported_again_somatize_is_not_compiled_again(compiling):
    first = fresh_import(compiling)
    assert len(first) > 10 and "_graph.py" in first, first  # its core, from source
    again = fresh_import(compiling)
    assert again == ["__init__.py"], again  # the package's own file only: it installs
    import somatize

    assert somatize.Graph.__module__ == "somatize._graph"  # and it works
    assert sys.meta_path.count(next(f for f in sys.meta_path
                                    if hasattr(f, "somatize_codes"))) == 1


def test_a_source_changed_on_disk_is_compiled_again(compiling, tmp_path):
    fresh_import(compiling)
    import somatize

    somatize.__path__.append(str(tmp_path))  # a module of the package, in a folder of ours
    probe = tmp_path / "_probe.py"
    probe.write_text("VALUE = 1\n")
    assert importlib.import_module("somatize._probe").VALUE == 1
    del sys.modules["somatize._probe"]
    compiling.clear()
    assert importlib.import_module("somatize._probe").VALUE == 1
    assert not compiling  # unchanged: its code object kept
    del sys.modules["somatize._probe"]
    probe.write_text("VALUE = 22\n")  # another size (and mtime)
    assert importlib.import_module("somatize._probe").VALUE == 22
    assert [p for p in compiling if p.endswith("_probe.py")]


def test_where_bytecode_is_written_nothing_is_installed(monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    meta = list(sys.meta_path)
    mine = [f for f in meta if hasattr(f, "somatize_codes")]
    monkeypatch.setattr(sys, "meta_path", [f for f in meta if f not in mine])
    _compiled.install()
    assert not [f for f in sys.meta_path if hasattr(f, "somatize_codes")]
