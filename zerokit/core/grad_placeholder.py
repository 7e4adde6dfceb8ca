"""``param.grad`` where no tensor of the parameter's shape holds its gradient on this rank.

At 'os_g' and 'p_g_os', and at 'os' by default (reduce-scattered), a rank holds only its shard
of each averaged gradient: flat pieces that may straddle parameters, not tensors of the
parameters' shapes. At 'os' with ``whole_grads=True`` the same is true under
mixed precision or offload (the optimizer steps from a gradient in another dtype or device),
under tensor parallelism (a gradient is a slice), and after ``step_in_backward`` (the gradient
is gone, already applied). Leaving ``param.grad = None`` there made
``torch.nn.utils.clip_grad_norm_`` return 0.0 and clip nothing: silently wrong. So such a
parameter's ``.grad`` is a ``GradPlaceholder``, which holds no storage and lets torch's own
clipping code run exactly:

* ``torch.linalg.vector_norm`` (or ``_foreach_norm``) of a placeholder gives a ``NormPart``:
  this parameter's contribution, still to be summed over the ranks; ``torch.stack`` of parts
  is a part; the ``vector_norm`` of that stack is the collective step — it returns the norm
  of the whole gradient, as one process computes it (``zerokit.clip.global_grad_norm``). That
  is the sequence ``torch.nn.utils.clip_grad_norm_`` runs, on every rank, so every rank makes
  the same collective at the same point (as FSDP2's DTensor gradients do).
* elementwise in-place updates by a number (``clamp_``, ``mul_``, ``div_``, ``zero_``,
  ``nan_to_num_`` — what the clips and manual unscaling do) are applied to every buffer that
  holds this rank's part of the gradient, so they are exact;
* anything else (reading values, arithmetic, a norm read on its own) raises
  ``ShardedGradError`` at that call, naming ``zerokit.clip_grad_norm_``.

``p.grad is None`` keeps torch's meaning: the parameter has no gradient on any rank. The
placeholder is dropped before autograd accumulates into ``p.grad`` again (a parameter hook in
``core/hooks.py``) and by ``zero_grad``.
"""

from __future__ import annotations

import weakref
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
    """Stands in ``param.grad``; see the module docstring. ``parts()`` returns the buffers that
    hold this rank's part of the gradient (None: already applied and freed); ``owner`` is a
    weak reference to the ``ShardState`` that computes global norms."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, parts: Callable[[], list | None], owner, why: str):
        t = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        t._parts, t._owner, t._why = parts, owner, why
        t._param_ref = weakref.ref(param)
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # printing must not raise
        return f"GradPlaceholder(shape={tuple(self.shape)}, {self._why})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0] if args else None
        if func is aten._foreach_norm.Scalar and len(args) < 3 and not kwargs.get("dtype"):
            return [t._norm_part(_norm_order(args, kwargs)) for t in this]
        if func is aten.linalg_vector_norm.default and _norm_args_plain(args, kwargs):
            return this._norm_part(_norm_order(args, kwargs))
        if func in _ELEMENTWISE_INPLACE and isinstance(this, GradPlaceholder):
            if all(_is_number(a) for a in (*args[1:], *kwargs.values())):
                this._apply_inplace(func, args[1:], kwargs)
                return this
        if func is aten._foreach_mul_.Tensor and _is_number(args[1]):
            for t in args[0]:
                t._apply_inplace(aten.mul_.Tensor, args[1:], kwargs)
            return None
        placeholder = next(a for a in _flat(args, kwargs) if isinstance(a, GradPlaceholder))
        raise ShardedGradError(placeholder._message(func))

    def _apply_inplace(self, func, args, kwargs) -> None:
        parts = self._parts()
        if parts is None:
            raise ShardedGradError(self._message(func))
        for part in parts:
            func(part, *args, **kwargs)

    def _norm_part(self, ord_: float) -> NormPart:
        if self._parts() is None or self._owner() is None:
            raise ShardedGradError(self._message(aten.linalg_vector_norm.default))
        return NormPart(self._owner, [self._param_ref()], [], ord_, self.device)

    def _message(self, func) -> str:
        return (
            f"this parameter's .grad is a placeholder: {self._why}. torch.nn.utils."
            "clip_grad_norm_ and clip_grad_value_ work on it, as do in-place mul_/div_/clamp_ "
            "by a number; reading its values does not (refused here: "
            f"{getattr(func, '__name__', func)}). To clip by norm you can also call "
            "zerokit.clip_grad_norm_(model, max_norm) on every rank"
        )


class NormPart(torch.Tensor):
    """A 0-dim stand-in for the norm of some placeholders' gradients (``params``) and of plain
    gradients' norms (``plain``), not yet summed over the ranks."""

    @staticmethod
    def __new__(cls, owner, params: list, plain: list, ord_: float, device, shape=()):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=device)
        t._owner, t._params, t._plain, t._ord = owner, params, plain, ord_
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"NormPart(of {len(self._params)} sharded gradients, ord={self._ord})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.stack.default and not kwargs.get("dim") and len(args) < 2:
            return cls._merge(args[0])
        if func in (aten._to_copy.default, aten.detach.default, aten.alias.default):
            return args[0]
        if func is aten.linalg_vector_norm.default and _norm_args_plain(args, kwargs):
            part = args[0]
            if part.dim() != 1:
                raise ShardedGradError("a sharded gradient's norm alone is not known here")
            return part._global(_norm_order(args, kwargs))
        raise ShardedGradError(
            f"{getattr(func, '__name__', func)} on the norm of a sharded gradient: it is known "
            "only summed over the ranks, in the sequence torch.nn.utils.clip_grad_norm_ runs "
            "(norms, stack, vector_norm). To read the gradient norm call "
            "zerokit.clip_grad_norm_(model, float('inf') or max_norm) on every rank"
        )

    @classmethod
    def _merge(cls, items) -> NormPart:
        parts = [t for t in items if isinstance(t, NormPart)]
        owners = {id(p._owner()) for p in parts}
        if len(owners) != 1 or None in {p._owner() for p in parts}:
            raise ShardedGradError(
                "torch.nn.utils.clip_grad_norm_ over the parameters of several zerokit "
                "models at once: clip each model with zerokit.clip_grad_norm_(model, ...)"
            )
        plain = [t for t in items if not isinstance(t, NormPart)]
        plain += [x for p in parts for x in p._plain]
        first = parts[0]
        params = [q for p in parts for q in p._params]
        return cls(first._owner, params, plain, first._ord, first.device, (len(items),))

    def _global(self, ord_: float) -> torch.Tensor:
        if ord_ != self._ord:
            raise ShardedGradError("the norms of one clip must all have the same order")
        state = self._owner()
        total = state.global_grad_norm({id(p) for p in self._params}, ord_)
        total = total.to(self.device, torch.float32)
        plain = (
            torch.stack([t.to(self.device, torch.float32) for t in self._plain])
            if (self._plain)
            else None
        )
        if plain is None:
            return total
        if ord_ == float("inf"):
            return torch.maximum(total, plain.max())
        return (total.pow(ord_) + plain.pow(ord_).sum()).pow(1.0 / ord_)


def _flat(args, kwargs) -> list:
    flat = []
    for a in (*args, *kwargs.values()):
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return flat


def _norm_order(args, kwargs) -> float:
    """The ``ord`` of a norm call (read only for norms: another op's second argument may be a
    whole tensor)."""
    return float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))


def _norm_args_plain(args, kwargs) -> bool:
    """A whole-tensor norm (no ``dim``, no ``keepdim``, no ``dtype``), as the clips take."""
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    return dim is None and not keepdim and kwargs.get("dtype") is None


def is_placeholder(grad) -> bool:
    return isinstance(grad, GradPlaceholder)
