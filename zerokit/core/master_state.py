"""``state_dict`` / ``load_state_dict`` in terms of the fp32 master weights.

Note: under mixed precision (or offload) the parameters the model sees are the compute copy
(bf16), while the values that train are the fp32 master shards. So a state dict must be
gathered from the masters (a bf16 copy would lose precision), and a load must write the
masters (else the next step would overwrite the loaded values with stale ones). Collective:
``model.state_dict()`` all-gathers each bucket's master shards.
"""

from __future__ import annotations

import torch
from torch import nn

from .collectives import start_all_gather_
from .flat_param import FlatParamBucket


class MasterStateDict:
    """The two hooks (``hooks.py`` registers them on the model when any bucket has masters of
    its own)."""

    def __init__(self, model: nn.Module, buckets: list[FlatParamBucket]):
        self.buckets = [b for b in buckets if b.separate_masters]  # each on its own group
        self.names = _names(model)  # id(parameter) -> every name it has

    def state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        """The fp32 masters of ``module``'s parameters under its names: the model's, a module
        sharing its parameters (a LightningModule), or a submodule's (only its buckets)."""
        names = _names(module)
        for bucket in self.buckets:  # [padded] fp32, on the device the group communicates on
            if not any(id(p) in names for p in bucket.params):
                continue  # the same on every rank: the module is
            full = torch.empty(
                bucket.layout.padded_numel, dtype=bucket.shard_data.dtype, device=bucket.data.device
            )
            bucket.shard(full).copy_(bucket.shard_data)
            start_all_gather_(full, bucket.group, ranges=bucket.ranges).finish()
            for i, param in enumerate(bucket.params):
                for name in names.get(id(param), ()):
                    state_dict[prefix + name] = bucket.slot_view(full, i)

    def load_hook(self, module, state_dict, prefix, *args) -> None:
        with torch.no_grad():
            for bucket in self.buckets:
                for piece, master in zip(bucket.pieces, bucket.param_pieces):
                    slot = bucket.layout.slots[piece.slot]
                    value = next(
                        (
                            state_dict[prefix + n]
                            for n in self.names[id(bucket.params[piece.slot])]
                            if prefix + n in state_dict
                        ),
                        None,
                    )
                    if value is not None and tuple(value.shape) == tuple(slot.shape):
                        master.copy_(value.reshape(-1)[piece.start : piece.end])


def _names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in ``module``."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return aliases
