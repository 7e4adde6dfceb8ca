"""``zerokit.unwrap``: the way back from ``group_sharded_parallel``.

>>> # plain_model, plain_opt = zerokit.unwrap(model, optimizer)   # every rank calls it

gives back the user's model and optimizer as they would be had one process trained them: full
parameters (the fp32 masters under mixed precision) in storage of their own, the model's and
optimizer's own classes, no hook of zerokit's left, and the optimizer's param groups holding
the parameters the user built it from (hyperparameters kept), each with its FULL optimizer
state (the core's ``release`` does it: the inverse of its ``build``).

Note: gradients are not given back (``.grad`` is None for every sharded parameter): at
'os_g' / 'p_g_os' no rank holds a full gradient. Call it between steps, after ``step()``.
Frozen parameters that mixed precision cast to the compute dtype stay in it.
"""

from __future__ import annotations

from torch import nn

from .core import as_optimizer_list, release, state_of, unwrap_compiled


def unwrap(model: nn.Module, optimizer):
    """Undo ``group_sharded_parallel`` on ``model`` and ``optimizer`` (or the list of
    optimizers wrapped with it), in place; returns them.

    Collective: every rank of the shard group (and its replicas) calls it, between steps.
    The model may be wrapped again afterwards."""
    state = state_of(unwrap_compiled(model))
    if state is None:
        raise ValueError(
            "zerokit.unwrap: this model is not wrapped by group_sharded_parallel (nothing to "
            "undo); pass the model group_sharded_parallel returned"
        )
    release(state, as_optimizer_list(optimizer))
    return model, optimizer
