"""``param.grad`` where no tensor of the parameter's shape holds its gradient on this rank.

At 'os_g' and 'p_g_os' a rank holds only its shard of each gradient: flat pieces that may
straddle parameters, not tensors of the parameters' shapes. At 'os' the same is true under
mixed precision or offload (the optimizer steps fp32 copies), under tensor parallelism (a
gradient is a slice), and after ``step_in_backward`` (the gradient is gone, already applied).
Leaving ``param.grad = None`` there made ``torch.nn.utils.clip_grad_norm_`` return 0.0 and
clip nothing: silently wrong. So such a parameter's ``.grad`` is a ``GradPlaceholder``:

* elementwise in-place updates by a number (``clamp_``, ``mul_``, ``div_``, ``zero_``,
  ``nan_to_num_`` — what ``clip_grad_value_`` and manual unscaling do) are applied to every
  buffer that holds this rank's part of the gradient, so they are exact;
* anything else (a norm, reading values, arithmetic) raises ``ShardedGradError`` at that call,
  on every rank, naming ``zerokit.clip_grad_norm_``.

It holds no storage. ``p.grad is None`` keeps torch's meaning: the parameter has no gradient
on any rank. The placeholder is dropped before autograd accumulates into ``p.grad`` again
(``ShardState.before_accumulate``) and by ``zero_grad``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

aten = torch.ops.aten

# In-place, elementwise, with every other argument a number: exact on any split of the elements.
_ELEMENTWISE_INPLACE = {
    aten.clamp_.default,
    aten.clamp_.Tensor,
    aten.clamp_min_.default,
    aten.clamp_max_.default,
    aten.mul_.Scalar,
    aten.mul_.Tensor,
    aten.div_.Scalar,
    aten.div_.Tensor,
    aten.zero_.default,
    aten.nan_to_num_.default,
}


class ShardedGradError(RuntimeError):
    """Code read ``param.grad`` the torch way where the gradient is sharded across ranks."""


def _is_number(x) -> bool:
    return (
        x is None
        or isinstance(x, (int, float, bool))
        or (isinstance(x, torch.Tensor) and not isinstance(x, GradPlaceholder) and x.dim() == 0)
    )


class GradPlaceholder(torch.Tensor):
    """Stands in ``param.grad``; see the module docstring."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, targets: Callable[[], list[torch.Tensor]], why: str):
        t = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        t._targets, t._why = targets, why
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # printing must not raise
        return f"GradPlaceholder(shape={tuple(self.shape)}, {self._why})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0] if args else None
        if (
            func in _ELEMENTWISE_INPLACE
            and isinstance(this, GradPlaceholder)
            and all(_is_number(a) for a in (*args[1:], *kwargs.values()))
        ):
            targets = this._targets()
            if targets is None:
                raise ShardedGradError(this._message(func))
            for target in targets:
                func(target, *args[1:], **kwargs)
            return this
        placeholder = next(a for a in (*args, *kwargs.values()) if isinstance(a, GradPlaceholder))
        raise ShardedGradError(placeholder._message(func))

    def _message(self, func) -> str:
        return (
            f"this parameter's .grad is a placeholder: {self._why}, so torch's "
            "clip_grad_norm_ (or any code reading gradient values) would see only this rank's "
            "part. To clip by norm, call zerokit.clip_grad_norm_(model, max_norm) on every "
            "rank instead: it returns the norm of the whole gradient, as one process would. "
            "torch.nn.utils.clip_grad_value_ and in-place mul_/div_/clamp_ by a number work on "
            f".grad as they are (refused here: {func.__name__})"
        )


def is_placeholder(grad) -> bool:
    return isinstance(grad, GradPlaceholder)
