"""A placed module stays an ordinary module: outputs keep their types (the script's own
classes included), exceptions keep theirs, attributes set here reach the worker, what the
forward leaves on its modules and the arguments it changes come back and train, and the
module pickles with nothing of somatize in it. Each fit runs plain and placed in a
subprocess (tests/placed_runs.py), against plain Lightning bit for bit."""

import collections
import dataclasses
import itertools
import pickle
import threading

import pytest
import torch
from oracle import exact as bits
from scenario import scenario

from somatize import WorkerError
from somatize.torch._raised import caught, rebuilt
from somatize.torch.placed._tree import tree_flatten, tree_unflatten

RUNS = "placed_runs.py"
pytestmark = pytest.mark.timeout(1500)  # one process runs every case (RPC starts once)
CASES = ["outputs", "raises", "attributes", "side", "cache", "pickles", "readers", "compiled",
         "shapes", "derived"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    where = tmp_path_factory.mktemp("placed")
    scenario(RUNS, "many", where / "all.pt", *CASES, timeout=900)
    return lambda case: torch.load(where / f"{case}.pt", weights_only=False)


def exact(got, placed="encoder"):
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert len(plain_losses) >= 4 and split_losses == plain_losses
    for k in plain:
        assert torch.equal(split[k], plain[k]), k
    ran = got["ran"][placed]
    assert got["pid"] not in ran and sum(ran.values()) >= len(split_losses)


def test_outputs_keep_the_scripts_own_types_and_train_the_placed_weights(ran):
    # a dataclass (with an init=False field), a ModelOutput look-alike, a namedtuple, all
    # defined in the script (__main__): they cross by value and come back as themselves
    got = ran("outputs")
    exact(got)
    plain, split = got["seen"]
    assert split == plain and split[-1] is True
    assert split[0] == (("Out", "Hidden", "Pair"), True, ["last_hidden_state", "pooled"])


def test_an_exception_over_there_is_raised_here_as_its_own_type_with_the_workers_traceback(
        ran):
    got = ran("raises")
    value, odd = got["value"], got["odd"]
    assert value["type"] == "ValueError" and value["is"]
    assert "the batch is odd" in value["message"] and "worker 'worker'" in value["message"]
    assert value["cause_type"] == "WorkerTraceback"
    assert "placed_runs.py" in value["cause"] and 'raise ValueError("the batch is odd")' in \
        value["cause"]
    assert odd["type"] == "Odd" and odd["is"] and "odder" in odd["message"]


def test_attributes_set_here_reach_the_worker_before_its_next_call(ran):
    # a callback sets the dropout's p each batch; BaseFinetuning(train_bn=False) sets
    # BatchNorm's track_running_stats to False at epoch 1: validation losses equal plain's
    got = ran("attributes")
    exact(got)
    plain, split = got["seen"]
    assert len(plain) >= 6 and split == plain  # sanity check and three epochs


def test_what_the_forward_leaves_on_its_modules_comes_back_and_trains(ran):
    # an auxiliary loss set on self, a child's features kept by a forward hook registered
    # before fit: both feed the loss, so their gradients reach the placed weights
    exact(ran("side"))


def test_arguments_changed_in_place_over_there_change_here(ran):
    got = ran("cache")
    exact(got)
    assert got["seen"][1] == got["seen"][0] == (2, 2.0)


def test_calls_whose_structure_changes_from_call_to_call_and_a_replaced_buffer_train_exactly(
        ran):
    # five calls a step: tensors alone, keyword tensors (one written into over there), a
    # string, one tensor twice; a tensor, a tuple, a dict and one tensor twice back. At
    # batch 2 a callback puts a new tensor under the buffer's name (no write: its version
    # is the old one's)
    got = ran("shapes")
    exact(got)
    plain, split = got["seen"]
    assert split == plain == [("Tensor", "dict", True, 1.0)] * 4


def test_the_placed_module_pickles_into_checkpoints_as_plain_lightnings(ran):
    # lightning-hydra-template keeps net in hparams: its checkpoint carries net's weights
    got = ran("pickles")
    plain, split = got["plain"], got["split"]
    assert split["seen"] == plain["seen"] == ("Sequential", False, "Sequential",
                                              ["Parameter"])
    # copies and pickles taken after each step carry the weights of that moment
    assert len(plain["copies"]) == len(split["copies"]) >= 6
    for mine, theirs in zip(split["copies"], plain["copies"], strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b)
    for part in ("state", "net"):
        assert plain[part].keys() == split[part].keys()
        for k in plain[part]:
            assert torch.equal(split[part][k], plain[part][k]), (part, k)
    for i, st in plain["optim"].items():
        for k, v in st.items():
            assert torch.equal(split["optim"][i][k], v), (i, k)


def test_readers_of_the_placed_weights_get_current_values_and_no_reader_costs_nothing(ran):
    # Lightning's EMAWeightAveraging and a mean-teacher target that follows the placed
    # encoder after each step: exact. Without them, steps bring no weights back
    got = ran("readers")
    plain, split, quiet = got["plain"], got["split"], got["quiet"]
    assert len(plain["losses"]) == 6 and split["losses"] == plain["losses"]
    for k, v in plain["weights"].items():
        assert torch.equal(split["weights"][k], v), k
    assert got["pid"] not in split["ran"]["encoder"]
    w = got["weight_bytes"]
    between = [b - a for a, b in itertools.pairwise(quiet["received"])]
    assert len(set(between)) == 1 and 0 < between[0] < w  # the output and RNG state
    read = [b - a for a, b in itertools.pairwise(split["received"])]
    assert read == [between[0] + w] * len(between)  # each step's read brought them, once


def test_an_in_place_compile_of_a_placed_module_is_refused_naming_it(ran):
    said = ran("compiled")["said"]
    assert "encoder.2.compile() was called in place" in said and "worker 'w'" in said
    assert "Compile before placing it" in said


def test_a_worker_of_another_organization_gets_no_rng_state_and_equals_its_oracle(ran):
    # Worker(rng="derived"): dropout over there draws from HMAC(key, where the call
    # stands); one piece with DerivedRNG draws the same: losses ==, weights torch.equal,
    # validation ==, and the RNG state here ends the same (the shuffle drew from it)
    got = ran("derived")
    oracle, derived, sent, plain = got["oracle"], got["derived"], got["sent"], got["plain"]
    assert len(oracle["losses"]) == 8 and derived["losses"] == oracle["losses"]
    bits(oracle["weights"], derived["weights"])
    assert derived["vals"] == oracle["vals"] and torch.equal(derived["rng"], oracle["rng"])
    assert plain["losses"] != oracle["losses"]  # the dropout draws: the seeds decide
    assert got["other_key"]["losses"] != oracle["losses"]  # and so does the key
    assert sent["losses"] == plain["losses"]  # the default still sends the RNG state
    bits(plain["weights"], sent["weights"])
    # the wire: every Call carries an int seed and no RNG state, every Answer none back;
    # the tensors are the activations, the outputs and their gradients, and the weights
    # the epoch ends bring here; none is a uint8 RNG state (the audit sees one when sent)
    audit = derived["audit"]
    assert len(audit["calls"]) == len(audit["answers"]) == 12  # 8 steps, 4 validation
    assert {c for c, _ in audit["calls"]} == {"int"}
    assert {a for a, _ in audit["answers"]} == {"NoneType"}
    assert {tuple(s) for _, s in audit["calls"]} == {((16, 64),)}
    assert {tuple(s) for _, s in audit["answers"]} == {((16, 8),)}
    shapes = {(16, 64), (16, 8), (32, 64), (32,), (8, 32), (8,)}
    assert {(dt, shape) for dt, shape, _ in audit["tensors"]} == {
        ("torch.float32", s) for s in shapes}
    assert ("torch.uint8", (5056,), 5056) in sent["audit"]["tensors"]
    calls = 2 * 4 + 2 + 2 * 2  # steps, the sanity check's and the epochs' validations
    assert [a - b for a, b in zip(sent["traffic"], derived["traffic"], strict=True)] == [
        5056 * calls] * 2


# -- the walker, in this process ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: int = dataclasses.field(default=3, init=False)


class Items(collections.OrderedDict):
    def __post_init__(self):
        raise AssertionError("ran twice")


@dataclasses.dataclass
class Both(Items):
    x: torch.Tensor = None


NT = collections.namedtuple("NT", "p q")


def test_the_walker_rebuilds_every_container_as_its_own_class_without_running_init_again():
    t, u = torch.ones(2), torch.zeros(3)
    both = Both.__new__(Both)
    collections.OrderedDict.__setitem__(both, "x", t)
    both.__dict__["x"] = t
    value = ([Frozen(t)], {"k": NT(t, (u, "s"))}, both, torch.max(u.view(3, 1), 1), [1, None])
    flat, spec = tree_flatten(value)
    assert sum(isinstance(v, torch.Tensor) for v in flat) == 4  # t once, though in 4 places
    spec = pickle.loads(pickle.dumps(spec))
    back = tree_unflatten([v * 2 if isinstance(v, torch.Tensor) else v for v in flat], spec)
    assert type(back[0][0]) is Frozen and back[0][0].b == 3 and torch.equal(back[0][0].a, t * 2)
    assert type(back[1]["k"]) is NT and back[1]["k"].q[1] == "s"
    assert type(back[2]) is Both and back[2]["x"] is back[2].x and back[2].x is back[0][0].a
    assert type(back[3]) is type(torch.max(u.view(3, 1), 1)) and back[4] == [1, None]
    counts = collections.defaultdict(list, {"a": [t]})
    again = tree_unflatten(*tree_flatten(counts))
    assert type(again) is collections.defaultdict and again["new"] == [] and again["a"] == [t]


class NeedsTwo(ValueError):
    """An exception its pickle cannot rebuild (its __init__ wants two arguments)."""

    def __init__(self, a, b):
        super().__init__(a)
        self.b = b


class HoldsALock(ValueError):
    """An exception with an attribute that does not pickle."""

    def __init__(self, a):
        super().__init__(a)
        self.lock = threading.Lock()


def test_an_exception_is_rebuilt_with_its_attributes_without_its_init_again():
    try:
        raise NeedsTwo("half", 2)
    except NeedsTwo as e:
        r = caught(e)
    e = rebuilt(r, "module 'enc' on worker 'w'")
    assert type(e) is NeedsTwo and e.b == 2  # on a708fa3: a WorkerError subclass, b lost
    assert e.args == ("half (raised in module 'enc' on worker 'w')",)
    assert "NeedsTwo: half" in str(e.__cause__) and "test_placed_ordinary.py" in str(e.__cause__)


def test_an_exception_that_cannot_be_rebuilt_is_both_a_worker_error_and_its_own_type():
    try:
        raise HoldsALock("half")
    except HoldsALock as e:
        r = caught(e)
    e = rebuilt(r, "module 'enc' on worker 'w'")
    assert isinstance(e, WorkerError) and isinstance(e, HoldsALock) and isinstance(e, ValueError)
    assert "module 'enc' on worker 'w' raised HoldsALock: half" in str(e)
    assert "HoldsALock: half" in str(e.__cause__)
    try:
        raise KeyError("k")
    except KeyError as e:
        same = rebuilt(caught(e), "module 'enc' on worker 'w'")
    assert type(same) is KeyError and same.args == ("k",)  # a key stays the key
    assert "raised in module 'enc' on worker 'w'" in same.__notes__[0]
