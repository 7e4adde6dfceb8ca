"""A checkpoint ``ZeroKitStrategy`` saved, as the one file Lightning reads on one process
(``zerokit ckpt consolidate DIR --lightning OUT.ckpt``, then ``load_from_checkpoint`` or
``fit(..., ckpt_path=)``): a ``torch.save``d dict of Lightning's keys; imports no Lightning.

``ZeroKitStrategy.save_checkpoint`` keeps each entry K of Lightning's checkpoint dict as the
extra state ``"lightning/K"``, all but the model and the optimizer, which it writes as shards.
This module rebuilds those two: ``state_dict`` under the LightningModule's own names (tied
names each) and ``optimizer_states`` as ``Optimizer.state_dict`` gives them.

Note: unlike the shards, the file is pickle (Lightning's format) and is built whole in memory.
An entry saved per rank is rank 0's, as Lightning's own ``save_checkpoint`` writes rank 0's.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .convert import optimizer_state, saved_extra
from .holdings import OPTIM_PREFIX
from .index import CheckpointError
from .reading import CheckpointReader

EXTRA_PREFIX = "lightning/"  # Lightning's checkpoint key K is the zerokit extra "lightning/K"


def consolidate_lightning(checkpoint: str | os.PathLike, output: str | os.PathLike) -> list[str]:
    """Write the Lightning checkpoint file ``output`` from the zerokit checkpoint directory
    ``checkpoint`` (saved by ``ZeroKitStrategy``); returns ``[output]``."""
    output = os.fspath(output)
    with CheckpointReader(checkpoint) as reader:
        _check_output(output, reader.directory)
        keys = [k for k in reader.index.get("extra", {}) if k.startswith(EXTRA_PREFIX)]
        if not keys:
            raise CheckpointError(
                f"{reader.directory} holds no Lightning state (it was not saved by "
                "ZeroKitStrategy): consolidate it to a .safetensors file instead"
            )
        reader.verify_all()
        state: dict[str, Any] = {k[len(EXTRA_PREFIX) :]: saved_extra(reader, k) for k in keys}
        state["state_dict"] = _model_state(reader)
        saved = reader.index["optimizer"]
        if saved is not None:  # not a weights-only save; several optimizers: one state each
            entries = saved if isinstance(saved, list) else [saved]
            state["optimizer_states"] = [_optimizer_state(reader, e) for e in entries]
    partial = f"{output}.partial-{os.getpid()}"
    try:
        torch.save(state, partial)
        os.replace(partial, output)
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)
    return [output]


def _check_output(output: str, directory: str) -> None:
    if os.path.isdir(output) or output.endswith(os.sep):
        raise CheckpointError(f"--lightning {output} is a directory: give a file name")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise CheckpointError(f"--lightning {output}: the directory {parent} does not exist")
    real = os.path.realpath(directory)
    if os.path.commonpath([os.path.realpath(output), real]) == real:
        raise CheckpointError(f"{output} is inside the checkpoint {directory} it reads")


def _model_state(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    index = reader.index
    state = {
        n: reader.read_full(n) for n in index["tensors"] if not n.startswith(OPTIM_PREFIX + ".")
    }
    for alias, target in index["aliases"].items():
        state[alias] = state[target]  # one tensor under both names, as torch saves tied weights
    return state


def _optimizer_state(reader: CheckpointReader, saved: dict) -> dict[str, Any]:
    """One saved optimizer as ``Optimizer.state_dict()``: parameters numbered 0, 1, ... in the
    order of their param groups (each optimizer of a list from 0, as Lightning stores them)."""
    aliases = reader.index["aliases"]
    if saved.get("quantized_state"):
        raise CheckpointError(
            f"{reader.directory}: its {saved['class']} state is block-quantized (torchao), "
            "which Lightning's file would hold as pickled torchao tensors: resume from the "
            "checkpoint directory itself, or consolidate the weights to a .safetensors file"
        )
    numbers: dict[str, int] = {}
    groups = []
    for group in saved["param_groups"]:
        ids = [numbers.setdefault(name, len(numbers)) for name in group["params"]]
        groups.append({**group["hyperparameters"], "params": ids})
    held = optimizer_state(reader, saved)  # under each tensor's stored name
    state = {n: held[aliases.get(p, p)] for p, n in numbers.items() if aliases.get(p, p) in held}
    return {"state": state, "param_groups": groups}
