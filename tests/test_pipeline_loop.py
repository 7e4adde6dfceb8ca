"""A pipeline in a loop of one's own: ``pipe.forward_backward`` (the schedule and
``finalize_grads``), then the same public calls as without a pipeline (``zerokit.clip_grad_norm_``,
``ShardedGradScaler``, ``optimizer.step()``).

pp 3 (a tied embedding on the first and last stages, a middle stage without it) and dp 2 x pp 2
under ZeRO: the losses, the clipping norm (the whole model's, before clipping) and the final
parameters equal one process on the whole batch (fp32, 2e-5). fp16-style loss scaling on
wrapped stages: with a power-of-two scale training equals one process, and an inf in one
stage's gradients skips the step on every stage and halves the scale everywhere.
"""

import pytest
import torch
from dist_helpers import run_distributed
from models import PLANT, VOCAB, global_batches, loss_fn, pipeline_reference, plant
from torch import nn

import zerokit
from zerokit.core.state import state_of
from zerokit.pipeline import LayerDesc, PipelineModule, SharedLayerDesc

ATOL = 2e-5
DIM, HIDDEN = 6, 10
CLIP = 0.3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):  # [B, T, DIM]
        return x + self.fc2(torch.tanh(self.fc1(x)))


def head(emb: nn.Embedding, x):  # [B, T, DIM] -> [B, T, VOCAB]
    return x @ emb.weight.t()


def tied_layers() -> list:
    """Split [0, 2, 4, 5] over 3 stages: the embedding on stage 0, the head tied to it on
    stage 2, stage 1 holding no copy."""
    return [
        SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, DIM),
        LayerDesc(Block),
        LayerDesc(Block),
        LayerDesc(Block),
        SharedLayerDesc("embed", nn.Embedding, head, "weight", VOCAB, DIM),
    ]


def reference(layers, batches):
    init, state, losses, norms = pipeline_reference(layers, batches, clip=CLIP)
    assert all(n > CLIP for n in norms), norms  # the clipping bites on every step
    return init, state, losses, norms


def load_stage(pipe: PipelineModule, state: dict) -> None:
    pipe.stage.load_state_dict({k: state[k] for k in pipe.stage.state_dict()})


def own_loop(pipe, opt, batches, mine=slice(None), clip_through=None):
    """Each step: forward_backward, the public clip, step, zero_grad. Losses and norms."""
    losses, norms = [], []
    for x, y in batches:
        losses.append(pipe.forward_backward((x[mine], y[mine]), "1f1b", 2).item())
        norms.append(zerokit.clip_grad_norm_(clip_through or pipe, CLIP).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def check(what, got, want, full_state, ref_state):
    for name, g, w in zip(("loss", "norm"), got, want):
        for step, (a, b) in enumerate(zip(g, w)):
            assert abs(a - b) <= ATOL, f"{what}: step {step}: {name} {a} != {b}"
    for name, value in full_state.items():
        torch.testing.assert_close(value, ref_state[name], atol=ATOL, rtol=0, msg=f"{what}: {name}")


def _pp3(rank, world_size):
    layers = tied_layers()
    batches = global_batches(3, batch=4)
    init, ref_state, ref_losses, ref_norms = reference(layers, batches)
    pipe = PipelineModule(layers, loss_fn, num_stages=3, partition=[0, 2, 4, 5])
    assert set(pipe.shared_groups) == ({"embed"} if rank != 1 else set())
    load_stage(pipe, init)
    opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
    got = own_loop(pipe, opt, batches)
    check("pp3 own loop", got, (ref_losses, ref_norms), pipe.stage.state_dict(), ref_state)


def test_pp3_forward_backward_public_clip_step_equals_one_process():
    run_distributed(_pp3, 3)


def _dp2_pp2(rank, world_size):
    """Wrapped stages (the PipelineModule given to group_sharded_parallel), the clip given
    the pipeline at one level and the stage at the other: the same whole-model norm."""
    layout = zerokit.init_hybrid_parallel(2, 1, pp_degree=2)
    layers = tied_layers()
    batches = global_batches(3, batch=8)
    init, ref_state, ref_losses, ref_norms = reference(layers, batches)
    mine = slice(layout.dp_rank * 4, layout.dp_rank * 4 + 4)
    for level in ("os_g", "p_g_os"):
        pipe = PipelineModule(layers, loss_fn, layout=layout, partition=[0, 2, 5])
        load_stage(pipe, init)
        opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
        pipe, opt, _ = zerokit.group_sharded_parallel(pipe, opt, level, group=layout.dp_group)
        through = pipe.stage if level == "p_g_os" else pipe
        got = own_loop(pipe, opt, batches, mine, through)
        check(
            f"dp2 x pp2 {level}", got, (ref_losses, ref_norms), pipe.stage.state_dict(), ref_state
        )


@pytest.mark.slow  # 4 ranks, two levels
def test_dp2_pp2_forward_backward_public_clip_step_equals_one_process():
    run_distributed(_dp2_pp2, 4)


# -- loss scaling --------------------------------------------------------------------------------
def scaled_layers() -> list:
    """Untied (a tied weight would carry the inf to the last stage by itself): split [0, 3, 5]."""
    return [
        LayerDesc(nn.Embedding, VOCAB, DIM),
        plant,
        LayerDesc(Block),
        LayerDesc(Block),
        LayerDesc(nn.Linear, DIM, VOCAB),
    ]


def _scaler(rank, world_size):
    """pp 2, each stage wrapped ('os_g', over a data-parallel group of one), fp32 with a
    ShardedGradScaler: the scale 2**10 divides out exactly, so training equals one process;
    then an inf on stage 0 only makes stage 1 skip too, and both halve the scale."""
    layout = zerokit.init_hybrid_parallel(1, 1, pp_degree=2)
    layers = scaled_layers()
    batches = global_batches(3, batch=4)
    init, ref_state, ref_losses, ref_norms = reference(layers, batches)
    pipe = PipelineModule(layers, loss_fn, layout=layout, partition=[0, 3, 5])
    load_stage(pipe, init)
    opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
    scaler = zerokit.ShardedGradScaler(init_scale=2.0**10)
    _, opt, scaler = zerokit.group_sharded_parallel(
        pipe.stage, opt, "os_g", group=layout.dp_group, scaler=scaler
    )
    losses, norms = [], []

    def step(batch):
        loss = pipe.forward_backward(batch, "1f1b", 2, scaler=scaler)
        scaler.unscale_(opt)
        norm = zerokit.clip_grad_norm_(pipe, CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.item(), norm.item()

    for batch in batches:
        loss, norm = step(batch)
        losses.append(loss)
        norms.append(norm)
    check(
        "pp2 ShardedGradScaler",
        (losses, norms),
        (ref_losses, ref_norms),
        pipe.stage.state_dict(),
        ref_state,
    )
    before = {k: v.clone() for k, v in pipe.stage.state_dict().items()}
    scale = scaler.get_scale()
    PLANT[0] = True  # on stage 0 (the only stage running plant); stage 1's gradients are finite
    step(batches[0])
    PLANT[0] = False
    for name, value in pipe.stage.state_dict().items():
        assert torch.equal(value, before[name]), f"stage {rank} stepped {name} on an inf"
    assert scaler.get_scale() == scale / 2, f"stage {rank}: scale {scaler.get_scale()}"
    assert state_of(pipe.stage) is not None
    loss, _ = step(batches[1])
    assert torch.isfinite(torch.tensor(loss)), "training goes on"
    assert any(not torch.equal(v, before[k]) for k, v in pipe.stage.state_dict().items())


def test_pp2_sharded_scaler_skips_on_every_stage():
    run_distributed(_scaler, 2)
