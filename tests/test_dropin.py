"""The drop-in route: unmodified LightningModules (Lightning's own demo Transformer, a
classic autoencoder, manual optimization, a siamese call) with submodules placed on a
worker by name, against plain Lightning bit for bit. Each run is a subprocess
(tests/dropin_runs.py, which plays those of tests/dropin_*_runs.py): RPC starts once per
process."""

import pytest
import torch
from oracle import same
from scenario import scenario

# the module-wide fixture plays every oracle in one scenario (its own timeout: 900 s),
# about 2.5 min on 2 cores: pytest-timeout's default 300 s is too near on a busy machine
pytestmark = pytest.mark.timeout(1200)


def run(tmp_path, *args, timeout=300):
    out = tmp_path / f"{args[0]}.pt"
    done = scenario("dropin_runs.py", args[0], out, *args[1:], timeout=timeout)
    return torch.load(out, weights_only=False), done.stderr


ORACLES = ["transformer", "autoencoder", "manual", "siamese", "many_calls", "gan", "finetune",
           "batchnorm", "siamese_bf16"]
PRECISIONS = ["bf16", "norm", "value", "bf16-norm", "16", "bf16-true"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The oracle and precision runs, in one process (each run a pair of fits): a case's
    results by name, e.g. ran("transformer"), ran("precision:16")."""
    where = tmp_path_factory.mktemp("dropin")
    cases = ORACLES + [f"precision:{p}" for p in PRECISIONS] + ["chosen", "devices", "stale",
                                                                 "said", "settings",
                                                                 "finetune_resumed",
                                                                 "unreadable"]
    run(where, "many", *cases, timeout=900)
    return lambda case: torch.load(where / f"{case.replace(':', '-')}.pt", weights_only=False)


@pytest.mark.parametrize("case,placed,calls_per_step", [
    ("transformer", "model.transformer", 1),   # Lightning's demo, dropout 0.2
    ("autoencoder", "encoder", 1),   # two param groups, per-step StepLR, accumulate 2
    ("manual", "encoder", 1),        # two optimizers stepped at different rates
    ("siamese", "encoder", 2),       # a dict of tensors, called twice per step
    ("many_calls", "encoder", 6),    # six backwards in flight over there at once
    ("gan", "generator", 2),         # toggle_optimizer freezes the generator here
    ("finetune", "backbone", 1),     # BackboneFinetuning adds a param group at epoch 1
    ("batchnorm", "encoder", 1),     # running statistics over there, validated each epoch
    ("siamese_bf16", "encoder", 2),  # two calls per step under bf16-mixed autocast
])
def test_a_placed_submodule_trains_over_there_to_plain_lightnings_numbers(
        ran, case, placed, calls_per_step):
    got = ran(case)
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert len(plain_losses) >= 5
    assert split_losses == plain_losses
    assert got["vals"][0] == got["vals"][1]  # validation losses, where the model keeps them
    assert plain.keys() == split.keys()  # the module's own keys: nothing renamed
    for k in plain:
        assert torch.equal(split[k], plain[k]), k
    # the placed module's forward ran in another process, once per call
    ran = got["ran"][placed]
    assert got["pid"] not in ran and len(ran) == 1
    assert sum(ran.values()) >= calls_per_step * len(split_losses)


@pytest.mark.parametrize("case", PRECISIONS)
def test_precision_and_clipping_cross_the_cut_to_plain_lightnings_numbers(ran, case):
    # bf16-mixed (CPU autocast), norm and value clipping over every parameter, both together,
    # 16-mixed with a CPU GradScaler (its first steps overflow: skipped on every side)
    got = ran(f"precision:{case}")
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert split_losses == plain_losses
    for k in plain:
        assert torch.equal(split[k], plain[k]), k
    assert plain_losses != got["as_is"]  # the setting changes the numbers: it was applied
    assert got["pid"] not in got["ran"]["encoder"]
    if case == "16":
        plain_scale, split_scale = got["scales"]
        assert plain_scale == split_scale < 2.0**24  # steps were skipped, the same ones


def test_a_worker_on_the_cpu_trains_exactly_and_one_given_a_missing_gpu_says_so(ran):
    got = ran("devices")
    assert got["split"][0] == got["plain"][0]
    assert all(torch.equal(got["split"][1][k], v) for k, v in got["plain"][1].items())
    assert "worker 'worker'" in got["said"] and "'cuda:0' but has no GPU" in got["said"]


def test_trains_chooses_the_optimizer_over_there_and_a_scheduler_it_cannot_follow_is_refused(
        ran):
    got = ran("chosen")
    assert got["split"][0] == got["plain"][0]
    assert all(torch.equal(got["split"][1][k], v) for k, v in got["plain"][1].items())
    assert "scheduler (StepLR)" in got["said"] and "'encoder'" in got["said"]


def test_a_checkpoint_written_under_the_strategy_is_plain_lightnings_and_resumes_both_ways(
        tmp_path):
    got, _ = run(tmp_path, "resumes", timeout=400)
    oracle = got["plain-plain"]  # plain Lightning resumed from its own epoch-1 checkpoint
    # written under the strategy after epoch 1: what plain Lightning writes
    assert same(got["split-plain"]["ckpt"], oracle["ckpt"])
    for resumed in ("plain-split", "split-plain"):
        assert got[resumed]["losses"] == oracle["losses"], resumed
        assert same(got[resumed]["weights"], oracle["weights"]), resumed


def test_the_copy_here_is_refused_during_fit_and_up_to_date_at_every_epoch_end(ran):
    got = ran("stale")
    assert "'encoder', which is placed on worker 'worker'" in got["said"]
    assert "stale" in got["said"] and "sync()" in got["said"]
    plain, split = got["seen"]["plain"], got["seen"]["split"]
    assert len(plain) == len(split) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain, split, strict=True))


# -- refused before the first batch, in this process (nothing starts a worker) ------------

import lightning.pytorch as pl  # noqa: E402
from dropin_models import AutoEncoder, digits  # noqa: E402
from torch import nn  # noqa: E402

from somatize import Refused  # noqa: E402
from somatize.lightning import SomatizeStrategy  # noqa: E402


def fit_here(model, strategy, **kw):
    pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, **kw,
               strategy=strategy).fit(model, digits())


def test_placing_a_missing_submodule_is_refused_with_the_names_nearby():
    with pytest.raises(Refused, match=r"place names 'encodr'.*\['encoder'"):
        fit_here(AutoEncoder(), SomatizeStrategy(place={"encodr": "worker"}))
    with pytest.raises(Refused, match=r"trains names \['encoder.0'\], which are not in the graph "
                                       r"nor placed.*\['encoder'\]"):
        fit_here(AutoEncoder(), SomatizeStrategy(place={"encoder": "worker"},
                                                 trains={"encoder.0": torch.optim.SGD}))


class Tied(AutoEncoder):
    def __init__(self):
        super().__init__()
        self.tied = nn.Linear(32, 8)
        self.tied.weight = self.encoder[3].weight  # one tensor, here and in the encoder


class WithLBFGS(AutoEncoder):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_a_weight_tied_across_the_cut_and_an_optimizer_with_a_closure_are_refused():
    with pytest.raises(Refused, match=r"'tied.weight' is the same tensor as one inside "
                                      r"'encoder'"):
        fit_here(Tied(), SomatizeStrategy(place={"encoder": "worker"}))
    with pytest.raises(Refused, match="LBFGS holds parameters of \\['encoder'\\]"):
        fit_here(WithLBFGS(), SomatizeStrategy(place={"encoder": "worker"}))


def test_more_than_one_device_is_refused_naming_devices():
    with pytest.raises(Refused, match=r"devices=2"):
        fit_here(AutoEncoder(), SomatizeStrategy(place={"encoder": "worker"}),
                 accelerator="cpu", devices=2)


def test_the_log_says_whether_a_placed_module_trains_over_there(ran):
    got = ran("said")
    assert len(got["trained"]) == 1 and len(got["frozen"]) == 1
    assert "runs and trains on worker 'worker'" in got["trained"][0]
    assert "runs on worker 'worker'" in got["frozen"][0]
    assert "does not train" in got["frozen"][0] and "trains on" not in got["frozen"][0]
    # a hook put here on a child during fit goes to the worker, where the child runs
    # (tests/test_placed_edges.py): nothing to say about it
    assert got["hooked"] == []


def test_the_math_settings_here_travel_with_each_call(ran):
    # threads, float32 matmul precision, deterministic algorithms, cuDNN benchmark: set
    # differently before each batch here, seen by the module over there in that batch
    seen = ran("settings")
    # (and CUBLAS_WORKSPACE_CONFIG, which Lightning's deterministic=True sets here), and
    # the CPU's own: oneDNN on or off, attention's fast path, denormals flushed, NNPACK
    want = [(1, "high", True, True, ":4096:8", True, True, False, True),
            (2, "medium", False, False, None, False, False, True, False),
            (1, "highest", False, True, None, True, False, False, False)]
    assert seen["followed"] == [want[i % 3] for i in range(6)]
    # a worker given its own thread count keeps it; the rest still follows
    assert seen["own"] == [(2, *want[i % 3][1:]) for i in range(6)]


def test_a_finetuning_run_resumed_after_its_backbone_joined_the_optimizer_is_exact(ran):
    # BackboneFinetuning restores the backbone's param group on resume; its Adam state
    # reaches the mirror over there
    got = ran("finetune_resumed")
    assert len(got["plain"][0]) >= 5 and got["split"][0] == got["plain"][0]
    for k, v in got["plain"][1].items():
        assert torch.equal(got["split"][1][k], v), k


def test_an_argument_whose_class_the_script_defines_crosses_and_trains_exactly(ran):
    got = ran("unreadable")
    assert len(got["plain"][0]) == 4 and got["split"][0] == got["plain"][0]
    for k, v in got["plain"][1].items():
        assert torch.equal(got["split"][1][k], v), k


def test_a_strategy_that_places_nothing_says_so(caplog):
    fit_here(AutoEncoder(), SomatizeStrategy(), max_steps=1)
    assert "SomatizeStrategy places nothing" in caplog.text
    assert "place={'encoder': 'worker'}" in caplog.text
