"""A dynamic loss scaler for fp16 whose skip decision is agreed across the ZeRO group.

torch's ``GradScaler`` looks for inf/nan in the gradients it can see. Under ZeRO each rank
sees only its shard of the gradients, so ranks would disagree: one would skip the step and
another apply it, and the replicas would part. Here the check covers this rank's gradient
pieces (every element once across the group) and one MAX all-reduce makes the answer the same
everywhere: every rank skips the same step and halves the scale together. With tensor
parallelism, tp ranks hold different gradients too, so the flag is also reduced over the tp
group, and for a pipeline's stage over the pipeline (every stage skips together). Rank-local
(``is_distributed``) parameters' gradients, in no bucket, are unscaled and checked too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .core import all_reduce_, as_optimizer_list, is_distributed, optimizer_params_of, state_of
from .grad_scope import grad_scope


def agree_found_inf(grads: list[torch.Tensor], groups, device: torch.device) -> bool:
    """Whether any of ``grads`` on any rank of ``groups`` holds an inf/nan: the same answer on
    every rank of them (one MAX all-reduce per group, on ``device``). Collective."""
    found = torch.zeros((), device=device)
    for g in grads:
        if g.is_meta:  # ``zerokit plan``'s dry run: no values, counted finite
            continue
        found = torch.maximum(found, (~torch.isfinite(g)).any().float().to(device))
    for group in groups:
        all_reduce_(found, group, op=dist.ReduceOp.MAX)
    return bool(found.item())


def step_and_zero(optimizer, scaler: ShardedGradScaler | None) -> None:
    """One optimizer step as a training loop takes it: through ``scaler`` when there is one
    (``step`` then ``update``), then ``zero_grad(set_to_none=True)``. ``optimizer`` may be a
    list (Muon beside AdamW): each steps, the scaler updates once, each zeroes."""
    optimizers = as_optimizer_list(optimizer)
    for opt in optimizers:
        scaler.step(opt) if scaler is not None else opt.step()
    if scaler is not None:
        scaler.update()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)


class ShardedGradScaler:
    """``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` (torch's contract),
    for an optimizer returned by ``group_sharded_parallel``. Call ``unscale_(opt)`` before
    ``clip_grad_norm_`` to clip the true gradients."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.enabled = growth_interval, enabled
        self._good_steps = 0
        self._unscaled: set[int] = set()
        self._unscaled_models: set[int] = set()  # ids of the ShardStates unscaled since update
        self._overflowed: dict[int, bool] = {}

    @classmethod
    def like(cls, scaler) -> ShardedGradScaler:
        """The same settings as a ``torch.amp.GradScaler``. A disabled one (nanoGPT passes
        ``GradScaler(enabled=dtype == 'float16')``) stays disabled: it holds no settings (torch
        sets none when disabled), and scales, unscales and skips nothing, as torch's."""
        if not scaler.is_enabled():
            return cls(enabled=False)
        return cls(
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )

    def get_scale(self) -> float:
        return self.scale_value if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * self.scale_value if self.enabled else outputs

    def unscale_(self, optimizer) -> None:
        """Divide this rank's gradients by the scale and agree whether any is inf/nan."""
        if not self.enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer since update()")
        state = state_of(optimizer)
        if state is None:
            raise TypeError(
                "ShardedGradScaler takes an optimizer returned by group_sharded_parallel"
            )
        state.check_ready_for_step()
        inv = 1.0 / self.scale_value
        mine = [p for params in optimizer_params_of(optimizer) for p in params]
        # rank-local parameters: in no bucket, their own .grad
        local = [p.grad for p in mine if is_distributed(p) and p.grad is not None]
        # the model's buffers hold every optimizer's gradients (Muon beside AdamW): they are
        # unscaled once, by the first optimizer's call; each optimizer checks its own pieces
        first = id(state) not in self._unscaled_models
        self._unscaled_models.add(id(state))
        for buffer in [*(state.grads_to_scale() if first else []), *local]:
            buffer.mul_(inv)
        ids = {id(p) for p in mine}
        grads = [g for p, g in state.owned_grad_pieces() if id(p) in ids] + local
        scope = grad_scope(state.model)
        # every rank of the ZeRO group (its replicas, the tp group, the pipeline) skips; agreed
        # where the group communicates (NCCL: the GPU), even if the shards are offloaded
        groups = [*state.agree_groups, *(scope.across if scope is not None else ())]
        found = agree_found_inf(grads, groups, state.communication_device)
        self._unscaled.add(id(optimizer))
        self._overflowed[id(optimizer)] = found

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step()`` unless some rank found inf/nan gradients (then every rank skips)."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._overflowed[id(optimizer)]:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Halve the scale after a skipped step; grow it after ``growth_interval`` good ones."""
        if not self.enabled:
            return
        if any(self._overflowed.values()):
            self.scale_value *= self.backoff_factor
            self._good_steps = 0
        elif self._overflowed:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self._good_steps = 0
        self._unscaled.clear()
        self._overflowed.clear()
        self._unscaled_models.clear()

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "growth_tracker": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self._good_steps = float(state["scale"]), int(state["growth_tracker"])
