"""A placed module is the same object on both sides, at the edges: what a callback
changes on it mid-fit (attributes of any kind, its structure, hooks on its children),
every backward through it (create_graph, retain_graph, autograd.grad on the input), a
residual across the cut, an argument object it changes in place; or a refusal naming
the module, what was wrong and what to do. Each fit runs plain and placed in one
subprocess (tests/placed_edges_runs.py), against plain Lightning."""

import pytest
import torch
from oracle import placed_exact
from scenario import scenario

RUNS = "placed_edges_runs.py"
pytestmark = pytest.mark.timeout(1500)  # one process runs every case (RPC starts once)
CASES = ["attributes", "unpicklable", "structure", "hooks", "hook_outside", "contextvar",
         "pinn", "heat", "two_answers", "stem_penalty", "wgan", "twice", "fgsm", "residual",
         "fan_out", "compiled_before",
         "kv_cache", "raised", "module_list", "generator_argument", "parametrized",
         "weight_norm_hook", "draws_random", "draws_numpy", "global_hook",
         "global_rebound", "global_same", "global_in_place", "global_record",
         "global_to_code"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    where = tmp_path_factory.mktemp("edges")
    scenario(RUNS, "many", where / "all.pt", *CASES, timeout=900)
    return lambda case: torch.load(where / f"{case}.pt", weights_only=False)


def exact(got, steps=4, placed="encoder", calls=4):
    placed_exact(got, placed, steps)
    kept_after_each_step(got, calls)


def kept_after_each_step(got, calls=4):
    # each call's graph over there is kept until the one here is freed: after a step,
    # at most the calls of that step (here, the graphs die with the step), never growing
    assert len(got["kept"]) >= 3 and max(got["kept"]) <= calls, got["kept"]


def test_a_tensor_a_list_a_dict_a_partial_an_enum_a_numpy_scalar_and_a_lambda_set_mid_fit(
        ran):
    exact(ran("attributes"), steps=5)


def test_an_attribute_that_cannot_be_sent_is_refused_naming_it(ran):
    said = ran("unpicklable")["said"]
    assert said.startswith("encoder.lin.guard was set here to lock")
    assert "cannot be sent to the worker running 'encoder'" in said
    assert "leave 'encoder' unplaced" in said


def test_a_child_replaced_a_buffer_a_child_and_a_parameter_registered_mid_fit(ran):
    got = ran("structure")
    exact(got, steps=5)
    assert got["split_seen"] == got["plain_seen"] and "extra.weight" in got["plain_seen"]


def test_hooks_the_modules_own_run_here_and_a_childs_put_after_placing_run_there(ran):
    # a hook on the placed module that writes into the model's dict; a hook put on a child
    # at batch 1 that sets an attribute on it (which feeds the loss), removed at batch 3
    exact(ran("hooks"), steps=5)


def test_a_childs_hook_that_writes_outside_its_module_is_refused_at_that_call(ran):
    said = ran("hook_outside")["said"]
    assert said.startswith("a hook on encoder.1, HookWritesOutside.on_train_batch_start.")
    assert "placed_edges_runs.py" in said and "changed 'FEATURES' (outside the module)" in said
    assert "Set what the hook records as an attribute of its module" in said


@pytest.mark.parametrize("case,which", [("draws_random", "Python's random"),
                                        ("draws_numpy", "numpy.random")])
def test_a_forward_that_draws_from_a_global_generator_over_there_is_refused(ran, case, which):
    # older Hugging Face layerdrop: random.uniform(0, 1) < p in the forward. Their states
    # here do not travel (torch's does): over there it would draw other numbers
    said = ran(case)["said"]
    assert said.startswith(f"the forward of 'encoder' drew from {which} (its global generator)")
    assert "torch.rand(()) < p" in said and "leave 'encoder' unplaced" in said


def test_a_hook_every_module_runs_is_refused_naming_the_placed_module(ran):
    # it would run around the module here, never around its children over there
    said = ran("global_hook")["said"]
    assert said.startswith("a forward hook registered for every module is on here")
    assert "not around its children, which run on worker 'worker'" in said
    assert "leave 'encoder' unplaced" in said


@pytest.mark.parametrize("case", ["global_rebound", "global_same", "global_in_place",
                                  "global_record"])
def test_the_globals_the_placed_code_reads_follow_this_process_mid_fit(ran, case):
    # GAIN rebound before each batch (or to an equal value), a config dict a helper of the
    # forward reads changed in place, a dataclass's and a namespace's fields set: the
    # worker's copy follows, as one piece
    exact(ran(case), steps=5)


def test_a_global_the_placed_code_reads_rebound_to_a_function_is_refused_naming_it(ran):
    said = ran("global_to_code")["said"]
    assert said.startswith("Gained.forward reads the global 'ACT', which was set here to a "
                           "builtin_function_or_method after 'encoder' was placed on worker")
    assert "Make it an attribute of the module" in said and "leave 'encoder' unplaced" in said


def test_hooks_that_read_a_context_variable_of_this_process_read_its_value_there(ran):
    # Hugging Face's output_hidden_states in miniature: hooks put lazily on the placed
    # encoder's layers, closures over a ContextVar whose collector is set here; the
    # collector travels with each call and what the hooks appended to it comes back
    got = ran("contextvar")
    exact(got)
    assert got["split_seen"] == got["plain_seen"] == [3] * 4


# A call and its create_graph answer whose backwards meet in one pass here run as one pass
# over there (placed/_joins.py): before, each was a pass of its own, a few ulps off.

def test_a_pinn_differentiates_through_the_placed_net_with_create_graph(ran):
    exact(ran("pinn"))  # on 1a8704c: losses equal, weights 4.7e-9 apart


def test_a_second_order_pinn_with_a_gradient_that_asks_for_one_back(ran):
    exact(ran("heat"), calls=3)  # on 1a8704c: losses differ at step 1, weights 3e-8 apart


def test_two_create_graph_answers_of_one_call_and_its_output_in_one_loss(ran):
    exact(ran("two_answers"), calls=3)  # on 1a8704c: losses differ, weights 1.5e-8 apart


def test_a_gradient_penalty_on_an_argument_computed_here_and_passed_in_twice(ran):
    exact(ran("stem_penalty"))  # on 1a8704c: losses differ, weights 3e-8 apart


def test_wgan_gp_with_the_critic_placed_is_exact(ran):
    # five calls a step; the penalty's first call lives as long as its answer (as the
    # forward's graph does in one piece, under the double backward's)
    exact(ran("wgan"), steps=3, calls=5)


def test_an_r1_penalty_and_a_second_backward_with_retain_graph(ran):
    exact(ran("twice"))  # on a708fa3: KeyError: 0 over there; on 1a8704c: 1.5e-8 apart


def test_fgsm_by_hand_does_not_add_to_the_placed_weights_grad(ran):
    exact(ran("fgsm"))


def test_a_tensor_used_once_inside_the_placed_module_and_twice_outside_is_exact(ran):
    exact(ran("residual"))


def test_a_tensor_used_thrice_inside_the_placed_module_and_twice_outside_is_exact(ran):
    # each use's gradient comes back apart, for the engine here to add them in plain's order
    exact(ran("fan_out"))


def test_compile_in_place_before_fit_is_refused_naming_the_module(ran):
    said = ran("compiled_before")["said"]
    assert said.startswith("encoder.2.compile() was called in place before fit")
    assert "the worker would run it uncompiled" in said


def test_an_argument_object_the_module_appends_to_changes_here(ran):
    # a KV cache (a plain class, like transformers' DynamicCache) handed to three calls
    got = ran("kv_cache")
    exact(got, steps=6)
    assert got["split_seen"] == got["plain_seen"] and got["plain_seen"][0][0] == 3


def test_an_exception_of_the_scripts_class_is_caught_here_with_its_attributes(ran):
    # OutOfRange(idx, limit): two required arguments, a message made of them; rebuilt here
    # without its __init__ again (on main: a WorkerError subclass, idx and limit lost)
    same_class, name, idx, limit, seen, args, said = ran("raised")["caught"]
    assert same_class and name == "OutOfRange" and (idx, limit, seen) == (12, 5, [12])
    assert said.startswith("index 12 over 5 (raised in module 'encoder' on worker 'worker'")
    assert args == (said,)


def test_a_module_list_placed_is_refused_at_placement_naming_its_children(ran):
    said = ran("module_list")["said"]
    assert said.startswith("'encoder' is placed (place={'encoder': 'worker'}) but is a "
                           "ModuleList, which has no forward of its own")
    assert "Place its children by name (place={'encoder.0': ...})" in said


def test_an_argument_that_cannot_be_sent_is_refused_naming_the_module_and_argument(ran):
    said = ran("generator_argument")["said"]
    assert said.startswith("'encoder' was called with argument 'steps' (generator), which "
                           "cannot be sent to worker 'worker'")
    assert "a list instead of a generator" in said


def test_a_parametrized_weight_norm_is_refused_in_the_words_of_place(ran):
    said = ran("parametrized")["said"]
    assert said.startswith("module 'encoder' (Sequential) is placed (place={'encoder': "
                           "'worker'}) but cannot be sent to worker 'worker'")
    assert "encoder.2 is parametrized" in said and ".at(" not in said
    assert "Use torch.nn.utils.weight_norm (the hook form, which pickles)" in said


def test_the_hook_form_of_weight_norm_that_the_refusal_advises_is_exact(ran):
    exact(ran("weight_norm_hook"))
