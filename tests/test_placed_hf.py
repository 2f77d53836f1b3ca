"""Hugging Face transformers with a layer, an encoder or the whole model placed, exact
against plain Lightning: tiny BERT and GPT-2 from configs (nothing downloaded) with
``output_hidden_states`` and ``output_attentions`` (the ContextVar that transformers'
hooks read is carried to the worker and back; its registry, filled when the model is
built, is registered over there), ``generate()`` in validation, and
``gradient_checkpointing_enable()`` after placing. All runs in one subprocess
(tests/placed_hf_runs.py): transformers imports once."""

import pytest
import torch
from oracle import placed_exact
from scenario import scenario

pytestmark = pytest.mark.timeout(900)
CASES = ["bert_layer", "bert_encoder", "bert_whole", "gpt_layer", "gpt_whole", "gpt_tied"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    where = tmp_path_factory.mktemp("hf")
    scenario("placed_hf_runs.py", "many", where / "all.pt", *CASES, timeout=600)
    return lambda case: torch.load(where / f"{case}.pt", weights_only=False)


def exact(got, placed, steps):
    placed_exact(got, placed, steps)
    assert got["split_seen"] == got["plain_seen"]


@pytest.mark.parametrize("case,placed", [("bert_layer", "encoder.encoder.layer.0"),
                                         ("bert_encoder", "encoder.encoder"),
                                         ("bert_whole", "encoder")])
def test_bert_hidden_states_and_attentions_with_a_layer_the_encoder_or_all_placed(
        ran, case, placed):
    got = ran(case)
    exact(got, placed, steps=3)
    assert got["plain_seen"] == [(3, 2)] * 3  # the embeddings' and each layer's; each layer's


def test_gpt2_a_layer_placed_generates_and_checkpoints_gradients_after_placing(ran):
    got = ran("gpt_layer")  # gradient_checkpointing_enable() at batch 1
    exact(got, "encoder.transformer.h.0", steps=4)
    generated = [s for s in got["plain_seen"] if isinstance(s, list)]
    assert len(generated) == 3 and len(generated[0][0]) == 9  # the sanity check, each epoch


def test_gpt2_placed_whole_generates(ran):
    exact(ran("gpt_whole"), "encoder", steps=4)


def test_gpt2s_transformer_alone_is_refused_its_tied_embedding_named(ran):
    said = ran("gpt_tied")["said"]
    assert said.startswith("parameter 'encoder.lm_head.weight' is the same tensor as one "
                           "inside 'encoder.transformer'")
    assert "Untie it, or place a module that holds both" in said
