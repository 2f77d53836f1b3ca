"""The optimizers over there follow the ones here (tests/placed_optimizer_runs.py runs
the fits, each case in a fresh process): every torch.optim optimizer and one written in
a script, rebuilt from the same constructor arguments, exact against plain Lightning;
those that cannot be rebuilt refused before the first batch; a checkpoint written after
fit returns complete; the private torch names the placed route relies on, pinned."""

import contextlib
import operator
import os
import subprocess

import pytest
import torch
from oracle import same
from scenario import scenario, start

from somatize.torch import _private

RUNS = "placed_optimizer_runs.py"

OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
              "RMSprop", "Rprop", "ASGD", "Adafactor", "Muon", "SignSGD"]
OPTIMIZERS = [n for n in OPTIMIZERS if n == "SignSGD" or hasattr(torch.optim, n)]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every run in one process (one worker, kept across fits): a case's results by name."""
    where = tmp_path_factory.mktemp("placed_optimizers")
    cases = [f"optimizers:{','.join(OPTIMIZERS)}", "refused", "after_fit"]
    scenario(RUNS, "many", where / "many.pt", *cases, timeout=900)
    return lambda case: torch.load(where / f"{case}.pt", weights_only=False)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_is_rebuilt_over_there_and_trains_to_plain_lightnings_numbers(
        ran, name):
    # two param groups at different rates, a per-step StepLR, settings away from defaults
    got = ran("optimizers")[name]
    plain, split = got["plain"], got["split"]
    assert len(plain["losses"]) == 4 and split["losses"] == plain["losses"]
    assert same(split["weights"], plain["weights"])
    # the optimizer state of a checkpoint written after fit: every entry, equal
    assert sorted(split["optimizer"][0]["state"]) == sorted(plain["optimizer"][0]["state"])
    assert same(split["optimizer"], plain["optimizer"])
    assert same(split["schedulers"], plain["schedulers"])


def test_an_optimizer_that_cannot_be_rebuilt_is_refused_before_the_first_batch(ran):
    said = ran("refused")
    text, step = said["NeedsScale"]
    assert step == 0
    assert "NeedsScale holds parameters of 'encoder'" in text
    assert "needs ['scale'], which it does not keep in its defaults" in text
    assert "trains={'encoder': Split(" in text
    text, step = said["KeepsClip"]
    assert step == 0
    assert "KeepsClip holds parameters of 'encoder'" in text
    assert "'clip' is 0.5 here and 1.0 over there" in text


def test_a_checkpoint_written_after_fit_is_complete_and_resumes_as_plain_lightnings(ran):
    got = ran("after_fit")
    plain, split = got["plain"], got["split"]
    # a placed 4-layer body (6 tensors) and a head (2): every entry, not only the head's
    assert sorted(split["ckpt"]["optimizer_states"][0]["state"]) == list(range(8))
    assert same(split["ckpt"]["optimizer_states"], plain["ckpt"]["optimizer_states"])
    assert same(split["ckpt"]["state_dict"], plain["ckpt"]["state_dict"])
    # the optimizer and the module here, read after fit: what plain has
    assert same(split["state_here"], plain["state_here"])
    # and a validation run after fit leaves them as they are
    assert same(split["validated"], plain["state_here"])
    assert same(split["module"], plain["module"])
    more, weights = split["resumed"]
    assert len(more) >= 4 and more == plain["resumed"][0]
    assert same(weights, plain["resumed"][1])


def test_lightning_hydra_templates_module_unmodified_checkpoints_plain_lightnings_last_ckpt(
        tmp_path):
    # MNISTLitModule's behaviour (tests/placed_optimizer_runs.py: TemplateModule), net.model
    # placed, checkpointed every epoch: last.ckpt's weights, optimizer states and the net
    # kept in hyper_parameters equal plain's
    scenario(RUNS, "template", tmp_path / "template.pt", timeout=600)
    got = torch.load(tmp_path / "template.pt", weights_only=False)
    assert got["split"]["said"] == got["plain"]["said"] == ""
    plain, split = got["plain"]["ckpt"], got["split"]["ckpt"]
    assert plain["epoch"] == split["epoch"] == 2
    assert same(split["state_dict"], plain["state_dict"])
    assert same(split["optimizer_states"], plain["optimizer_states"])
    assert same(split["lr_schedulers"], plain["lr_schedulers"])
    assert split["net"][0] == plain["net"][0] == "DenseNet"
    assert same(split["net"][1], plain["net"][1])


# -- the private torch names the placed route relies on (somatize/torch/_private.py) ------

def test_each_private_torch_name_relied_on_exists_and_does_what_it_is_used_for():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    assert scaler.scale(torch.tensor(1.0)).item() == 4.0  # the scale is made at first use
    assert _private.scaler_scale(scaler).item() == 4.0  # the tensor behind get_scale()
    opt = torch.optim.SGD([p := torch.nn.Parameter(torch.ones(3))], lr=0.1)
    p.grad = torch.full((3,), 8.0)
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    assert "found_inf_per_device" in _private.scaler_found_inf(scaler, opt)
    assert _private.scaler_found_inf_if_any(scaler, torch.optim.SGD([p])) == {}
    g = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
    assert [n.item() for n in _private.foreach_norm(g, 2.0)] == [5.0, 1.0]
    _private.foreach_mul_(g, torch.tensor(2.0))
    assert torch.equal(g[0], torch.tensor([6.0, 8.0]))
    found = torch.zeros(1)
    _private.unscale_(g, found, torch.tensor(0.5))
    assert torch.equal(g[1], torch.tensor([1.0])) and found.item() == 0.0
    m = torch.nn.Linear(1, 1)
    m.register_forward_hook(lambda *a: None)
    m.register_forward_pre_hook(lambda *a: None)
    m.register_full_backward_hook(lambda *a: None)
    assert _private.hook_count(m) == 3
    # a module's own parameters, buffers and children, as torch registers them
    seq = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    bn = seq[0]
    assert _private.registered(bn, "weight") and _private.registered(bn, "running_mean")
    assert _private.registered(seq, "0") and not _private.registered(bn, "momentum")
    params, buffers = _private.own_tensors(bn)
    assert params == (bn.weight, bn.bias)
    assert buffers == (bn.running_mean, bn.running_var, bn.num_batches_tracked)
    before = _private.structure([seq, bn])
    assert all(map(lambda a, b: all(map(operator.is_, a, b)), before,
                   _private.structure([seq, bn])))
    bn.weight = torch.nn.Parameter(bn.weight.detach().clone())  # replaced: seen
    assert not all(map(operator.is_, before[1], _private.structure([seq, bn])[1]))


def test_a_missing_private_name_is_named_with_the_torch_version():
    class Scaler:  # what a torch without GradScaler._scale would give
        pass

    with pytest.raises(_private.TorchChanged, match=r"Scaler\._scale is missing from torch "
                                                    r"\d.*somatize/torch/_private\.py"):
        _private.scaler_scale(Scaler())


# -- Ctrl-C: the coordinator alone interrupted at random moments of a placed fit ----------

def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def _tree(pid: int) -> set[int]:
    kids, todo, seen = _children(), [pid], set()
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo += kids.get(p, [])
    return seen


def _alive(pids: set[int]) -> set[int]:
    left = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(p)
        except OSError:
            pass
    return left


@pytest.mark.timeout(900)
def test_ctrl_c_at_any_moment_of_a_placed_fit_ends_every_process_within_ten_seconds(tmp_path):
    # twenty fits (started five at a time, run on one at a time), each interrupted at a
    # random moment after its first batch by SIGINT to the coordinator alone; each process
    # tree ends within 10 s
    import random
    import signal
    import time

    rng = random.Random(18)
    tries, at_once, results, started = 20, 5, [], []
    try:
        for first in range(0, tries, at_once):
            running = []
            for k in range(first, min(first + at_once, tries)):
                out = tmp_path / f"interrupted-{k}.pt"
                marker = tmp_path / f"interrupted-{k}.pt.started"  # after the first batch
                proc = start(RUNS, "interrupted", out, stdout=subprocess.DEVNULL)
                started.append(proc)
                running.append((k, proc, marker, rng.uniform(0.0, 1.5)))
            for k, proc, marker, delay in running:
                deadline = time.monotonic() + 180
                while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert marker.exists(), (k, proc.poll())
                (tmp_path / f"interrupted-{k}.pt.go").touch()  # this one runs on, alone
                time.sleep(delay)
                # its process tree, and its workers (forked by conftest's server, not by it)
                workers = {int(p) for p in marker.read_text().split()[1:]}
                assert workers, (k, "no worker ran the placed module")
                tree = _tree(proc.pid) | workers
                sent = time.monotonic()
                proc.send_signal(signal.SIGINT)
                try:
                    _, err = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    err = ""
                while time.monotonic() < sent + 10 and _alive(tree):
                    time.sleep(0.05)
                left = _alive(tree)
                said = "interrupted (Ctrl-C)" in err or "KeyboardInterrupt" in err
                results.append((k, round(delay, 2), round(time.monotonic() - sent, 2),
                                sorted(left), said, err[-600:]))
                for p in left:  # never left behind, whatever the verdict
                    with contextlib.suppress(OSError):
                        os.kill(p, signal.SIGKILL)
    finally:
        for k, proc in enumerate(started):
            marker = tmp_path / f"interrupted-{k}.pt.started"
            workers = {int(p) for p in marker.read_text().split()[1:]} if marker.exists() \
                else set()
            for p in _alive(_tree(proc.pid) | workers):
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
    hung = [r for r in results if r[3]]
    assert not hung, hung
    assert all(r[2] < 10 for r in results), results
    # what was not brought here is said
    assert all(r[4] for r in results), results
