"""``zerokit verify --pp P``: the model (a ``zerokit.models.gpt.GPT``) as a ``PipelineModule``
of ``models.gpt.gpt_layers``, its stage wrapped by ZeRO over the stage's data-parallel ranks,
trained by ``forward_backward`` on the rank's rows; its whole model's full parameters, under
the plain GPT's names, to compare with one process's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import group_sharded_parallel
from ..layout import Layout
from ..mixed_precision import MixedPrecision
from ..models.gpt import GPT, gpt_layers, gpt_pipeline_state_dict
from ..pipeline import PipelineModule
from ..scaler import ShardedGradScaler, step_and_zero
from ..tensor_parallel import gather_full_state_dict


class PipelineTrainer:
    """``plain``'s parameters as a pipeline over ``layout``'s stages, each stage's rank
    holding and stepping its ZeRO shard of the stage (``layout.dp_group``)."""

    def __init__(self, plain: GPT, loss_fn, layout: Layout, make_optimizer, level: str, low, cfg):
        self.cfg, self.layout = plain.cfg, layout
        # the workload's loss, as the one-process runs use (cross-entropy in fp32)
        self.pipe = PipelineModule(gpt_layers(self.cfg), loss_fn, layout=layout)
        whole = gpt_pipeline_state_dict(plain.state_dict(), self.cfg)
        stage = self.pipe.stage
        stage.load_state_dict({k: whole[k] for k in stage.state_dict()})  # the same start
        stage.to(next(plain.parameters()).device)
        self.names = _plain_names(plain)
        optimizer = make_optimizer(stage.parameters())
        scaler = ShardedGradScaler() if low == torch.float16 else None
        _, self.optimizer, self.scaler = group_sharded_parallel(
            stage, optimizer, level, scaler=scaler, group=layout.dp_group,
            mixed_precision=MixedPrecision(param_dtype=low),
        )  # fmt: skip
        self.schedule, self.micro_batches = cfg.schedule, cfg.micro_batches or cfg.pp

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        """One step on this rank's rows; the global batch's mean loss (every rank has it)."""
        torch.manual_seed(1000 + step)  # as one process draws for the batch
        loss = self.pipe.forward_backward(
            (x, y), self.schedule, self.micro_batches, scaler=self.scaler
        )
        step_and_zero(self.optimizer, self.scaler)
        return loss.detach().double()

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """On rank 0: the whole model's full parameters under the plain GPT's names (every
        stage's first data-parallel rank sends its stage's; collective over the world)."""
        mine = {
            k: v.detach().float().cpu() for k, v in gather_full_state_dict(self.pipe.stage).items()
        }
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine if self.layout.dp_rank == 0 else None)
        if dist.get_rank() != 0:
            return None
        whole = {k: v for part in parts if part is not None for k, v in part.items()}
        return {name: whole[piped] for name, piped in self.names.items()}


def _plain_names(plain: GPT) -> dict[str, str]:
    """Each plain GPT parameter's name -> its name in the pipeline's stages."""
    named = dict(plain.named_parameters(remove_duplicate=False))
    piped = gpt_pipeline_state_dict({k: k for k in named}, plain.cfg)
    out = {plain_name: pipe_name for pipe_name, plain_name in piped.items()}
    if plain.cfg.tie_weights:  # one tensor: the head's weight is the embedding's
        out["lm_head.weight"] = out["wte.weight"]
    return {k: v for k, v in out.items() if k in named}
