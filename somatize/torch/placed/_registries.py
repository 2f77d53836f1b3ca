"""What building a module registered in its process, which pickling the module does not
carry: Hugging Face's ``_CAN_RECORD_REGISTRY`` (which outputs ``output_hidden_states``
and ``output_attentions`` collect, by the model's class), filled by
``PreTrainedModel.__init__``; a model unpickled in a fresh process lacks it and returns
``hidden_states=None``. Read here when the module is placed, registered over there before
its first call, so a model placed whole returns what it returns here.

    entries = registered(module)     # here, when placed
    register(entries)                # over there, before the first call
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

# (module, registry): dicts keyed by the string of a module's class
_KNOWN = (("transformers.utils.output_capturing", "_CAN_RECORD_REGISTRY"),)


def registered(module: torch.nn.Module) -> tuple:
    """``(module, registry, key, value)`` for each entry a known registry holds for the
    classes of ``module`` and its children."""
    entries = []
    for where, name in _KNOWN:
        registry = getattr(sys.modules.get(where), name, None)
        if not isinstance(registry, dict):
            continue
        for key in dict.fromkeys(str(type(m)) for m in module.modules()):
            if key in registry:  # (dict's own: the registry's get() takes a model)
                entries.append((where, name, key, dict.__getitem__(registry, key)))
    return tuple(entries)


def register(entries: Any) -> None:
    """Over there: the entries in this process's registries."""
    for where, name, key, value in entries:
        dict.__setitem__(getattr(importlib.import_module(where), name), key, value)
