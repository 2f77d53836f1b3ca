"""`pip install .` (the distribution somatize-torch) ships the library alone: the wheel,
built here from a copy of the repository (no network, no build isolation), holds
`somatize` and nothing of the example (`examples/`, `train.py`, `configs/`), and only the
`examples` extra asks for what the example needs (Hydra, scikit-learn)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_the_library_and_none_of_the_example(tmp_path):
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for folder in ["somatize", "examples", "configs"]:
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    for file in ["pyproject.toml", "README.md", "train.py"]:
        shutil.copy(ROOT / file, src / file)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=120)
    [wheel] = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"somatize", wheel.name.split("-py3")[0]
                                                + ".dist-info"}, sorted(names)
    assert "somatize/lightning/__init__.py" in names and "somatize/py.typed" in names
    assert not [n for n in names if "digits" in n or "examples" in n], names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA")))
    # the distribution's name is free on the index ("somatize" is another project's), and
    # its version is the one the package says (somatize --version)
    import somatize

    head = dict(line.split(": ", 1) for line in meta.decode().splitlines()[:3] if ": " in line)
    assert head["Name"] == "somatize-torch" and head["Version"] == somatize.__version__, head
    assert wheel.name.startswith(f"somatize_torch-{somatize.__version__}-")
    for dep in ["scikit-learn", "hydra-core"]:
        asked = [line for line in meta.decode().splitlines()
                 if line.startswith(f"Requires-Dist: {dep}")]
        assert asked and all("extra == \"examples\"" in line for line in asked), asked
