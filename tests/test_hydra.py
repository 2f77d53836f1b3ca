"""train.py and configs/ with real Hydra: composition and overrides in-process, and
`python train.py ...` as real processes that must exit 0."""

import os
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from scenario import ROOT, scenario
from test_torchrun import EMBEDDED_SAYS, EMBEDDED_SAYS_UNLESS


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
    assert [n for n, _ in model.named_children()] == ["body", "head"]


def test_the_example_model_is_plain_lightning_its_file_imports_nothing_from_somatize():
    import ast

    import examples.digits as digits

    tree = ast.parse(open(digits.__file__).read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += ["." * n.level + (n.module or "") for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom)]
    assert "lightning.pytorch" in imported
    assert not [m for m in imported if m.startswith(("somatize", "."))], imported


def test_split_option_places_what_somatize_place_says_the_body_unless_overridden():
    from somatize.lightning import SomatizeStrategy

    strategy = instantiate(config("+somatize=split").trainer.strategy)
    assert isinstance(strategy, SomatizeStrategy)
    # nothing chosen: every placed module mirrors the optimizer here
    assert strategy.place == {"body": "worker"} and strategy.trains == {}
    for overrides, place in [
            (["~somatize.place", "+somatize.place={head: worker}"], {"head": "worker"}),
            (["somatize.place.body=gpu"], {"body": "gpu"}),
            (["++somatize.place.head=worker"], {"body": "worker", "head": "worker"})]:
        assert instantiate(config("+somatize=split", *overrides).trainer.strategy
                           ).place == place, overrides


def test_split_option_takes_rng_derived_from_the_hydra_line_and_refuses_another_value():
    from hydra.errors import InstantiationException

    from somatize.lightning._derived import derived_draws
    from somatize.remote import Worker

    def draws(strategy):
        return derived_draws(strategy.workers, strategy.place, strategy.rng, strategy.rng_key)

    sent = instantiate(config("+somatize=split").trainer.strategy)
    assert (sent.rng, sent.rng_key, draws(sent)) == ("sent", "somatize", None)
    derived = instantiate(config("+somatize=split", "somatize.rng=derived").trainer.strategy)
    assert (derived.rng, draws(derived).keys) == ("derived", {"body": "somatize"})
    keyed = instantiate(config("+somatize=split", "somatize.rng=derived", "somatize.rng_key=run-7",
                               "++somatize.place.head=gpu",
                               'somatize.workers={gpu: "127.0.0.1:7000"}').trainer.strategy)
    assert draws(keyed).keys == {"body": "run-7", "head": "run-7"}  # an address: the line's
    # a Worker given in Python says its own
    assert draws(type(keyed)(place={"body": "w"}, workers={"w": Worker.at("h:1")},
                             rng="derived")) is None
    with pytest.raises(InstantiationException) as e:
        instantiate(config("+somatize=split", "somatize.rng=derivd").trainer.strategy)
    assert "SomatizeStrategy(rng='derivd'): say one of 'sent', 'derived'" in str(e.value)


def test_cached_option_caches_the_body_by_name_and_adds_the_callback():
    cfg = config("+somatize=cached", "somatize.store=/tmp/nowhere")
    assert cfg.data.shuffle  # shuffled: the body's outputs are kept item by item
    cb = instantiate(cfg.callbacks.somatize_cache)
    assert cb.store == "/tmp/nowhere" and list(cb.modules) == ["body"] and cb.per_item
    assert list(instantiate(config("+somatize=cached", "somatize.cache=[head]")
                            .callbacks.somatize_cache).modules) == ["head"]


def train(tmp_path, *overrides, timeout=240):
    done = scenario(ROOT / "train.py", "trainer.max_epochs=1", "data.limit=64",
                    f"hydra.run.dir={tmp_path / 'run'}", *overrides, cwd=tmp_path,
                    timeout=timeout)
    return done.stdout + done.stderr


def pid_of(out: str, module: str, where: str = "here") -> int:
    """The process train.py says ran ``module`` (counted by the process that ran it)."""
    found = re.search(rf"module '{module}' (?:ran|was called) in process (\d+) \({where}\) "
                      r"\d+ times", out)
    assert found, out[-3000:]
    return int(found.group(1))


# a short fit of a few steps and two epochs: what the study test compares with
LINE = ["trainer.max_epochs=2", "data.limit=64", "data.batch_size=16",
        "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """``python train.py`` of LINE, in one piece: its directory and what it said."""
    d = tmp_path_factory.mktemp("plain")
    done = scenario(ROOT / "train.py", *LINE, f"hydra.run.dir={d}", cwd=d)
    return d, done.stdout + done.stderr


def test_python_train_py_trains_plainly(plain):
    _, out = plain
    assert f"module 'body' ran in process {pid_of(out, 'head')} (here)" in out
    assert "accuracy on held-out digits" in out


def test_python_train_py_places_the_module_the_command_line_names(tmp_path):
    out = train(tmp_path, "+somatize=split", "~somatize.place", "+somatize.place={head: worker}",
                "somatize.rng=derived", "test=false")
    assert pid_of(out, "head", "worker 'worker'") != pid_of(out, "body")
    assert ("placed modules ['head'] draw their randomness over there from a generator "
            "derived per call (rng='derived')") in out, out[-3000:]
    # and a local worker process was started for it (the control of test_torchrun's
    # "none was"): what an embedded worker logs with no OpenMP wait policy given
    if not set(EMBEDDED_SAYS_UNLESS) & set(os.environ):
        assert EMBEDDED_SAYS in out, out[-3000:]


def test_python_train_py_keeps_the_placed_bodys_outputs_over_there(tmp_path):
    out = train(tmp_path, "+somatize=[split,cached]", f"somatize.store={tmp_path / 'store'}",
                "test=false")
    assert pid_of(out, "body", "worker 'worker'") != pid_of(out, "head")
    # the validation items kept during the sanity check were read back at epoch end
    found = re.search(r"SomatizeCache: modules \['body'\] computed their output for (\d+) "
                      r"items and read it from the store \S+ for (\d+)", out)
    assert found and int(found.group(1)) >= 1 and int(found.group(2)) >= 1, out[-3000:]
    assert any((tmp_path / "store" / "items").rglob("packs/*.safetensors"))


def test_train_py_reaches_a_standing_worker_on_another_host_with_its_token(hosts, tmp_path):
    """The cross-machine line of docs/lightning.md: the coordinator on host a listens on
    its address (somatize.listen), the body runs on the standing worker on host b
    (somatize.workers), which serves only the holder of its token (somatize.token_file)."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from remote_run import env

    a, b = hosts["a"], hosts["b"]
    home = tmp_path / "b-home"
    bare = {k: v for k, v in env().items() if k != "SOMATIZE_TOKEN"}  # tokens by file here
    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        daemon = b.popen([sys.executable, "-m", "somatize.worker", "--name", "gpu", "--listen",
                          f"{b.addr}:7000"], env={**bare, "XDG_CONFIG_HOME": str(home)},
                         stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        token = tmp_path / "gpu.token"  # the copy the coordinator holds, mode 0600
        shutil.copy(home / "somatize" / "worker-gpu.token", token)
        token.chmod(0o600)
        line = ["+somatize=split", "somatize.place.body=gpu", f"somatize.listen={a.addr}",
                f'somatize.workers={{gpu: "{b.addr}:7000"}}', "trainer.max_epochs=1",
                "data.limit=64", f"hydra.run.dir={tmp_path / 'run'}"]
        done = a.run([sys.executable, str(ROOT / "train.py"), *line,
                      f"somatize.token_file={token}"], timeout=240, env=bare, cwd=tmp_path)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        body = pid_of(out, "body", "worker 'gpu'")
        assert body != pid_of(out, "head") and "accuracy on held-out digits" in out
        assert log.read_text().count("run joined: serving process pid") == 1, log.read_text()
        # a link for the token: refused in one line that says what to give, no traceback
        link = tmp_path / "link.token"
        link.symlink_to(token)
        done = a.run([sys.executable, str(ROOT / "train.py"), *line,
                      f"somatize.token_file={link}"], timeout=240, env=bare, cwd=tmp_path)
        said = done.stdout + done.stderr
        assert done.returncode == 1 and "Traceback" not in said, said[-3000:]
        [refusal] = [s for s in said.splitlines() if "token file" in s]
        assert f"the token file {link} is a symbolic link" in refusal, said[-3000:]
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)


def test_a_token_file_missing_a_link_or_a_directory_is_refused_in_one_line_naming_it(tmp_path):
    from somatize import WorkerError
    from somatize.remote._secret import read_token_file

    real = tmp_path / "real.token"
    real.write_text("0" * 64)
    real.chmod(0o600)
    (tmp_path / "link.token").symlink_to(real)
    (tmp_path / "dir.token").mkdir()
    for name, says in [("gone.token", "does not exist"), ("link.token", "is a symbolic link"),
                       ("dir.token", "is a directory")]:
        path = tmp_path / name
        try:
            read_token_file(str(path))
        except WorkerError as e:
            said = str(e)
        else:
            raise AssertionError(f"{name} was read")
        assert "\n" not in said and said.startswith(f"the token file {path} {says}"), said
        assert "give SOMATIZE_TOKEN_FILE a copy of the worker's token file" in said, said
    assert read_token_file(str(real)) == b"0" * 64


def test_the_commands_the_cli_names_run_its_version_and_errors_are_one_line(capsys, tmp_path):
    import somatize
    from somatize._cli import USAGE, main

    assert main(["show", str(ROOT / "examples" / "digits_graph.py")]) == 0  # its docstring's
    assert "body  Body   worker" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"somatize {somatize.__version__}\n"
    assert "store {ls,du,verify,gc,drop}" in USAGE
    assert main(["show", str(tmp_path / "gone.py")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gone.py: No such file or directory" in err, err


def test_python_train_py_as_the_one_owner_of_a_study_equals_plain_lightning(plain, tmp_path):
    """`+somatize=splitfed` end to end: a real hub (`somatize hub`, certificates from
    `somatize fed cert`) holds the body, train.py is the study's one owner; its losses,
    validation and test numbers are plain train.py's (==), and the weights are (the body
    the hub's, at its last barrier; the head the owner's checkpoint's) bit for bit."""
    import csv
    import time

    import torch

    from somatize._cli import main
    from somatize.fed import load_round

    pki, ck, ready = tmp_path / "pki", tmp_path / "ck", tmp_path / "ready"
    assert main(["fed", "cert", str(pki), "hub", "hospital"]) == 0  # the CA, then each party
    (tmp_path / "digits.toml").write_text(
        '[study]\nname = "digits"\nowners = ["hospital"]\n'
        '[server]\nmodule = "fed_models:DigitsBody"\nkwargs = { hidden = 32 }\n'
        'init = "seed:0"\n'  # train.py's seed: the body it starts with
        'optimizer = { class = "torch.optim.SGD", lr = 0.5, momentum = 0.9 }\n'
        '[fedavg]\nparts = ["head"]\n')
    from scenario import start

    hub = start("hub_run.py", "--study", tmp_path / "digits.toml", "--listen", "127.0.0.1:0",
                "--identity", pki / "hub.pem", "--ca", pki / "ca.pem", "--checkpoints", ck,
                "--ready", ready)  # somatize hub, forked from the warm process
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert hub.poll() is None and time.monotonic() < deadline, hub.communicate()
            time.sleep(0.1)
        owner = scenario(ROOT / "train.py", *LINE, f"hydra.run.dir={tmp_path / 'owner'}",
                         "+somatize=splitfed", f"somatize.study.config={tmp_path / 'digits.toml'}",
                         f"somatize.study.hub=127.0.0.1:{ready.read_text()}",
                         "somatize.study.owner=hospital",
                         f"somatize.study.identity={pki / 'hospital.pem'}",
                         f"somatize.study.ca={pki / 'ca.pem'}", cwd=tmp_path)
    finally:
        hub.terminate()
        hub.wait(30)
    said = {}
    dirs = {"plain": plain[0], "owner": tmp_path / "owner"}
    for name, out in (("plain", plain[1]), ("owner", owner.stdout + owner.stderr)):
        found = re.search(r"accuracy on held-out digits: (\S+)", out)
        assert found, out[-3000:]
        said[name] = found.group(1)
    assert said["owner"] == said["plain"]
    rows, numbers = {}, ("train_loss", "val_loss", "val_acc", "test_acc")
    for name in ("plain", "owner"):
        with open(dirs[name] / "logs" / "version_0" / "metrics.csv") as f:
            logged = [{k: r[k] for k in ("step", *numbers)} for r in csv.DictReader(f)]
            rows[name] = [r for r in logged if any(r[k] for k in numbers)]  # (not somatize/*)
    assert [r["train_loss"] for r in rows["owner"] if r["train_loss"]] and (
        rows["owner"] == rows["plain"])
    want = torch.load(dirs["plain"] / "checkpoints" / "last.ckpt",
                      weights_only=False)["state_dict"]
    got = torch.load(tmp_path / "owner" / "checkpoints" / "last.ckpt", weights_only=False)
    assert got["somatize"]["study"]["round"] == 2
    body, ledger = load_round(ck, "digits")
    assert [e["kind"] for e in ledger].count("step") == 8
    for k, v in want.items():
        mine = body[k[5:]] if k.startswith("body.") else got["state_dict"][k]
        assert torch.equal(mine, v), k
