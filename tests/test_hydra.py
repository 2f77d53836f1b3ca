"""train.py and configs/ with real Hydra: composition and overrides in-process, and
`python train.py ...` as real processes that must exit 0."""

import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from test_torchrun import EMBEDDED_SAYS, EMBEDDED_SAYS_UNLESS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def config(*overrides):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig().set_config(cfg)  # so ${hydra:...} resolves as under train.py
    return cfg


def test_the_default_config_trains_in_one_piece_and_overrides_apply():
    cfg = config("trainer.max_epochs=3", "model.lr=0.2")
    assert "strategy" not in cfg.trainer
    trainer = instantiate(cfg.trainer, enable_progress_bar=False, logger=False)
    assert trainer.max_epochs == 3
    model = instantiate(cfg.model)
    assert model.hparams.lr == 0.2
    assert model.net.graph.placement.get("body") == "worker"  # declared, not obeyed here


def test_split_option_sets_the_strategy_and_its_split_pickles_with_overridden_lr():
    from somatize.lightning import SomatizeStrategy
    from somatize.torch import Split

    cfg = config("+somatize=split", "somatize.trains.body.lr=0.05")
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, SomatizeStrategy)
    split = strategy.trains["body"]
    assert isinstance(split, Split)
    again = pickle.loads(pickle.dumps(split))
    opt = again.factory([torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is torch.optim.SGD
    assert opt.defaults["lr"] == 0.05


def test_cached_option_declares_the_body_frozen_and_cached_and_adds_the_callback():
    cfg = config("+somatize=cached", "somatize.store=/tmp/nowhere")
    assert cfg.model.frozen and cfg.model.cached and not cfg.data.shuffle
    cb = instantiate(cfg.callbacks.somatize_cache)
    assert cb.store == "/tmp/nowhere"


def train(tmp_path, *overrides, timeout=240):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "trainer.max_epochs=1",
         "data.limit=64", f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def pid_of(out: str, node: str, where: str = "here") -> int:
    """The process train.py says ran ``node`` (counted by the process that ran it)."""
    found = re.search(rf"node '{node}' ran in process (\d+) \({where}\)", out)
    assert found, out[-3000:]
    return int(found.group(1))


def test_python_train_py_trains_plainly(tmp_path):
    out = train(tmp_path)
    assert f"node 'body' ran in process {pid_of(out, 'head')} (here)" in out
    assert "accuracy on held-out digits" in out


@pytest.mark.parametrize("option", ["split", "cached"])
def test_python_train_py_with_a_somatize_option_exits_0(tmp_path, option):
    out = train(tmp_path, f"+somatize={option}", f"somatize.store={tmp_path / 'store'}"
                if option == "cached" else "somatize.trains.body.lr=0.05")
    if option == "split":
        assert pid_of(out, "body", "worker 'worker'") != pid_of(out, "head")
        # and a local worker process was started for it (the control of test_torchrun's
        # "none was"): what an embedded worker logs with no OpenMP wait policy given
        if not set(EMBEDDED_SAYS_UNLESS) & set(os.environ):
            assert EMBEDDED_SAYS in out, out[-3000:]
    else:
        assert (tmp_path / "store").is_dir()
