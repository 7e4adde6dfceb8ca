"""``MixedPrecision``: compute in a low-precision copy, keep fp32 master weights as shards.

Note: with a policy, a bucket holds two copies of its parameters. The compute copy
(``bucket.data``, ``param_dtype``) is what the model's parameters are views of, so forward
and backward run in it. The master copy is the rank's shard in the parameters' own dtype
(``bucket.shard_data``, fp32), the only thing the optimizer updates; after each step the
updated shard is cast into the compute copy, which the all-gather then spreads (stage 3
gathers the compute dtype directly: half the bytes). Gradients arrive in ``param_dtype`` and
are reduced in ``reduce_dtype`` into fp32 gradient shards. A policy with only ``reduce_dtype``
computes in the parameters' own dtype and reduces in ``reduce_dtype`` (e.g. bf16 reduction of
fp32 training: half the bytes sent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """A mixed-precision policy for ``group_sharded_parallel(..., mixed_precision=...)``.

    >>> MixedPrecision(param_dtype=torch.bfloat16).gradient_reduce_dtype()
    torch.float32
    >>> MixedPrecision(reduce_dtype=torch.bfloat16).gradient_reduce_dtype()
    torch.bfloat16
    >>> MixedPrecision().gradient_reduce_dtype() is None  # the parameters' own dtype
    True
    """

    param_dtype: torch.dtype | None = None
    """dtype of the compute copy of the parameters (forward and backward run in it), e.g.
    ``torch.bfloat16`` or ``torch.float16``; None keeps the parameters' own dtype. Frozen
    floating-point parameters are cast to it too (they have no master copy: they never
    change); buffers and non-float parameters are left alone."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are averaged across ranks in, whatever ``param_dtype`` is (the reduced
    gradient shards the optimizer reads stay in the master weights' dtype). None: fp32 when
    ``param_dtype`` is set (for accuracy), else the parameters' own dtype. ``torch.bfloat16``
    halves the gradient bytes sent, at bf16's rounding of the average."""
    cast_forward_inputs: bool = True
    """Cast the floating-point tensors passed to the model's forward to ``param_dtype`` (as
    FSDP2 does), so a float32 batch meets bf16 weights. Integer inputs (token ids) are left
    alone."""
    output_dtype: torch.dtype | None = None
    """Cast the floating-point tensors the model's forward returns to this dtype (e.g.
    ``torch.float32`` for the loss); None leaves them in ``param_dtype``."""
    full_precision_modules: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
    """Module classes kept in the parameters' own dtype (fp32): their parameters get no
    low-precision copy, their floating inputs are cast up and their outputs back down to
    ``param_dtype``. BatchNorm by default: its kernel needs its weight in the dtype of its
    running statistics, which stay fp32."""

    def gradient_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in; None means the parameters' own dtype."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return torch.float32 if self.param_dtype is not None else None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _FLOATS:
                raise ValueError(
                    f"MixedPrecision.{field} must be a floating dtype such as torch.bfloat16, "
                    f"got {value!r}"
                )


#: the precision names every entry point takes: group_sharded_parallel, ShardingConfig,
#: load_config's files, Strategy, parallelize and the commands' --mixed-precision
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Lightning's precision names (Trainer and Fabric) that zerokit honours, as ours (None: fp32)
LIGHTNING_PRECISIONS = {"32-true": None, "16-mixed": "fp16", "bf16-mixed": "bf16"}


def as_policy(value) -> MixedPrecision | None:
    """``mixed_precision`` as a policy: None, a ``MixedPrecision``, or a name of
    ``PRECISIONS`` (compute in that dtype, fp32 master shards).

    >>> as_policy("bf16") == MixedPrecision(param_dtype=torch.bfloat16)
    True
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    names = " or ".join(repr(n) for n in PRECISIONS)
    if isinstance(value, str):
        if value not in PRECISIONS:
            raise ValueError(f"mixed_precision must be {names} (or None), got {value!r}")
        return MixedPrecision(param_dtype=PRECISIONS[value])
    raise TypeError(
        f"mixed_precision must be a zerokit.MixedPrecision policy, a name {names}, or None; got "
        f"{type(value).__name__} {value!r}"
    )
