"""A model handed to zerokit already compiled, and the names a compiled model goes by.

``torch.compile(module)`` returns an ``OptimizedModule`` that holds the module as its child
``_orig_mod``, so every name under it gains ``_orig_mod.``. zerokit shards the module inside
(``unwrap_compiled``) and gives the user back the compiled object they passed, which calls
the sharded module, so their compiled callable keeps working; two state-dict hooks
(registered by ``hooks.py`` on every ``OptimizedModule``) make that object's ``state_dict`` /
``load_state_dict`` use the plain model's names, and checkpoints
(``plain_name``) never contain the prefix, whichever order compile and wrap came in.
"""

from __future__ import annotations

import torch
from torch import nn

_INNER = "_orig_mod"  # the child name torch.compile gives the module it wraps


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``model`` itself if it is not compiled)."""
    while isinstance(model, torch._dynamo.OptimizedModule):
        model = model._orig_mod
    return model


def plain_name(name: str) -> str:
    """``blocks.0._orig_mod.fc.weight`` -> ``blocks.0.fc.weight``."""
    return ".".join(part for part in name.split(".") if part != _INNER)


def drop_inner_prefix(module, state_dict, prefix: str, local_metadata) -> None:
    inner = f"{prefix}{_INNER}."
    # this module's keys are the last ones written: moving them in order keeps the order
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # the wrapped module's own entry (its version) takes the compiled wrapper's place
        metadata[prefix[:-1]] = metadata.pop(inner[:-1], metadata.get(prefix[:-1]))
        for key in [k for k in metadata if k.startswith(inner)]:
            metadata[prefix + key[len(inner) :]] = metadata.pop(key)


def add_inner_prefix(module, state_dict, prefix: str, *args) -> None:
    inner = f"{prefix}{_INNER}."
    # load_state_dict works on its own copy of the caller's dict: renaming here is safe
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
