"""Hugging Face transformers, as users write them, with a layer, an encoder or the whole
model placed: tiny BERT and GPT-2 built from configs (nothing downloaded), with
``output_hidden_states=True`` and ``output_attentions=True`` (collected by hooks that
transformers puts on the layers lazily and a ContextVar it sets here; a registry filled
when the model is built), GPT-2's ``generate()`` in validation (a ``DynamicCache``
changed in place over there), ``gradient_checkpointing_enable()`` after placing. Runs of
a real lightning.Trainer, plain and placed, in one process (transformers imports once);
tests/test_placed_hf.py reads what they save:

    python tests/placed_hf_runs.py many OUT.pt bert_layer bert_whole gpt_layer ...
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch.utils.data as tud
from torch.nn import functional as F
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402
from placed_edges_runs import both, refused  # noqa: E402


def tokens(n=24, seq=9):
    g = torch.Generator().manual_seed(0)
    return tud.DataLoader(tud.TensorDataset(torch.randint(0, 99, (n, seq), generator=g)),
                          batch_size=8)


class Bert(pl.LightningModule):
    """A tiny BERT (dropout on), its hidden states and attentions in the loss."""

    def __init__(self):
        super().__init__()
        self.encoder = BertModel(BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
            vocab_size=99, attn_implementation="eager"))
        self.head = torch.nn.Linear(32, 99)
        self.seen = []

    def training_step(self, batch, i):
        x = batch[0]
        out = self.encoder(x, output_hidden_states=True, output_attentions=True)
        self.seen.append((len(out.hidden_states), len(out.attentions)))
        loss = F.cross_entropy(self.head(out.last_hidden_state).flatten(0, 1), x.flatten())
        loss = loss + 0.01 * sum(h.pow(2).mean() for h in out.hidden_states) \
            + sum(a.pow(2).mean() for a in out.attentions)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def bert(out, place):
    both(Bert, out, place={place: "worker"}, data=tokens(), max_steps=3,
         extra=lambda m: m.seen)


def bert_layer(out):
    bert(out, "encoder.encoder.layer.0")


def bert_encoder(out):
    bert(out, "encoder.encoder")


def bert_whole(out):
    bert(out, "encoder")


class Gpt(pl.LightningModule):
    """A tiny GPT-2 LM: hidden states and attentions in the loss, generate() in validation,
    and (``checkpointing``) gradient_checkpointing_enable() at batch 1."""

    def __init__(self, checkpointing=False):
        super().__init__()
        self.encoder = GPT2LMHeadModel(GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=32,
            attn_implementation="eager"))
        self.checkpointing = checkpointing
        self.seen = []

    def training_step(self, batch, i):
        if self.checkpointing and i == 1:
            self.encoder.gradient_checkpointing_enable()
        x = batch[0]
        out = self.encoder(x, labels=x, output_hidden_states=True, output_attentions=True)
        self.seen.append((len(out.hidden_states), len(out.attentions)))
        loss = out.loss + 0.01 * sum(h.pow(2).mean() for h in out.hidden_states) \
            + sum(a.pow(2).mean() for a in out.attentions)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, i):
        got = self.encoder.generate(batch[0][:, :4], max_new_tokens=5, do_sample=False,
                                    pad_token_id=0)
        self.seen.append(got.tolist())

    def val_dataloader(self):
        return tokens(8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def gpt(out, place, checkpointing=False):
    both(lambda: Gpt(checkpointing), out, place={place: "worker"}, data=tokens(),
         max_epochs=2, limit_train_batches=2, limit_val_batches=1, extra=lambda m: m.seen)


def gpt_layer(out):
    gpt(out, "encoder.transformer.h.0", checkpointing=True)


def gpt_whole(out):
    gpt(out, "encoder")


def gpt_tied(out):
    # GPT-2's lm_head is tied to the transformer's embedding: placing the transformer alone
    # would train one weight in two places
    refused(Gpt, out, place="encoder.transformer", data=tokens(), max_steps=1)


def many(out, *cases):
    oracle.many(globals(), out, cases)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
