"""Pipeline stages with tensor-parallel layers, and with mixed precision.

tp 2 x pp 2: column/row-parallel blocks (some sequence-parallel, across the stage boundary),
a vocabulary-parallel embedding tied to the head across stages, clipping on; stages not
wrapped and wrapped by ZeRO; the full (gathered) state equals one process training the whole
batch (fp32, 2e-5).

Mixed precision, dp 2 x pp 2, bf16 (MixedPrecision) and fp16 with the ShardedGradScaler, by
test_mixed_precision.py's criterion: no farther from exact fp32 training than one process
running the same policy, within a factor 4 (losses; RMS over the fp32 masters). An inf planted
in one stage's gradients makes every rank of every stage skip the step and halve the scale. A
torch.amp.GradScaler on stages not wrapped: fp32 equal to one process, and the same skip.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_distributed
from models import PLANT, global_batches, pipeline_reference, plant
from torch import nn

import zerokit
from zerokit import tensor_parallel as tp
from zerokit.core.state import state_of
from zerokit.models.gpt import lm_loss
from zerokit.pipeline import LayerDesc, PipelineModule, PipelineStage, SharedLayerDesc

ATOL = 2e-5
VOCAB = 12  # even: the vocabulary is split in equal halves across 2 tp ranks
DIM, HIDDEN, SEQ = 8, 12, 6  # SEQ even: sequence-parallel blocks split it across tp
CLIP = 0.5


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``; with a ``layout``: fc1 column-, fc2 row-parallel;
    ``sequence_parallel``: on this tp rank's block of positions ([T/tp, B, C]), the LayerNorm's
    parameters and fc2's bias then marked ``sequence_parallel``."""

    def __init__(self, layout=None, sequence_parallel: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        if layout is not None:
            sp = {"sequence_parallel": sequence_parallel, "layout": layout}
            self.fc1 = tp.ColumnParallelLinear(DIM, HIDDEN, gather_output=False, **sp)
            self.fc2 = tp.RowParallelLinear(HIDDEN, DIM, input_is_parallel=True, **sp)
            for p in self.ln.parameters():
                if sequence_parallel:
                    p.sequence_parallel = True
        else:
            self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def to_sequence(x):  # [B, T, C] -> [T, B, C]
    return x.transpose(0, 1).contiguous()


def from_sequence(x):
    return x.transpose(0, 1).contiguous()


def tp_to_sequence(group, x):  # [B, T, C] -> this tp rank's positions [T/tp, B, C]
    return tp.scatter_to_sequence_parallel_region(to_sequence(x), group)


def tp_from_sequence(group, x):  # replicated layers follow: their gradient is whole everywhere
    gathered = tp.gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False)
    return from_sequence(gathered)


def head(emb, x):  # [B, T, C] -> [B, T, vocab]
    return x @ emb.weight.t()


def tp_head(emb, x):  # this rank's vocabulary rows, logits gathered over tp
    group = emb.layout.tp_group
    return tp.gather_from_tp_region(F.linear(tp.copy_to_tp_region(x, group), emb.weight), group)


def tp_layers(layout=None) -> list:
    """Eight layers; the stages split them [0, 4, 8], inside the sequence-parallel region.
    With a ``layout``, tensor- and sequence-parallel; without, the plain model."""
    parallel = layout is not None
    emb = tp.VocabParallelEmbedding if parallel else nn.Embedding
    on = {"layout": layout} if parallel else {}
    group = layout.tp_group if parallel else None
    return [
        SharedLayerDesc("embed", emb, None, "weight", VOCAB, DIM, **on),
        LayerDesc(MLPBlock, layout),
        functools.partial(tp_to_sequence, group) if parallel else to_sequence,
        LayerDesc(MLPBlock, layout, parallel),
        LayerDesc(MLPBlock, layout, parallel),
        functools.partial(tp_from_sequence, group) if parallel else from_sequence,
        LayerDesc(MLPBlock, layout),
        SharedLayerDesc("embed", emb, tp_head if parallel else head, "weight", VOCAB, DIM, **on),
    ]


def reference_run(layers, batches, clip):
    init, state, losses, norms = pipeline_reference(layers, batches, lm_loss, clip)
    assert all(norm > clip for norm in norms)  # the clipping bites
    return init, state, losses


def _tp_pp(rank, world_size):
    layout = zerokit.init_hybrid_parallel(1, 2, pp_degree=2)
    assert (layout.pp_rank, layout.tp_rank) == divmod(rank, 2)
    batches = global_batches(3, batch=4, seq=SEQ, vocab=VOCAB)
    init, ref_state, ref_losses = reference_run(tp_layers(), batches, CLIP)
    for level in (None, "os_g"):
        what = f"tp2 x pp2 {'unwrapped' if level is None else level}"
        pipe = PipelineModule(tp_layers(layout), lm_loss, layout=layout, partition=[0, 4, 8])
        assert set(pipe.shared_groups) == {"embed"}
        keys = pipe.stage.state_dict().keys()
        tp.load_full_state_dict(pipe.stage, {k: init[k] for k in keys})
        opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
        if level is not None:  # dp 1: ZeRO over a group of one, the tp group at its side
            _, opt, _ = zerokit.group_sharded_parallel(
                pipe.stage, opt, level, group=layout.dp_group
            )
        losses = [pipe.train_batch(b, opt, "1f1b", 2, clip_norm=CLIP).item() for b in batches]
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= ATOL, f"{what}: step {step}: {got} != {want}"
        full = tp.gather_full_state_dict(pipe.stage)
        assert full.keys() == keys
        for name, value in full.items():
            torch.testing.assert_close(
                value,
                ref_state[name],
                atol=ATOL,
                rtol=0,
                msg=lambda m, n=name, w=what: f"{w}: {n}: {m}",
            )
        x, y = batches[0]
        with torch.no_grad():  # the reference's final model on the first batch
            model = PipelineStage(tp_layers(), 0)
            model.load_state_dict(ref_state)
            want = lm_loss(model(x), y).item()
        got = pipe.eval_batch(batches[0], micro_batches=2).item()
        assert abs(got - want) <= ATOL, f"{what}: eval {got} != {want}"


@pytest.mark.slow  # 4 ranks, two wrappings: 30 s on 2 shared cores, 90 s when busy
def test_tp2_pp2_tensor_parallel_stages():
    run_distributed(_tp_pp, 4)


# -- mixed precision ---------------------------------------------------------------------------
def mp_layers() -> list:
    return [
        LayerDesc(nn.Embedding, VOCAB, DIM),
        plant,
        LayerDesc(MLPBlock),
        LayerDesc(MLPBlock),
        LayerDesc(MLPBlock),
        LayerDesc(nn.Linear, DIM, VOCAB),
    ]


def float_loss(logits, y):  # the loss in fp32, from low-precision logits
    return lm_loss(logits.float(), y)


def low_precision_reference(layers, batches, dtype, loss_scale):
    """One process running the policy by hand (test_mixed_precision's): a compute copy in
    ``dtype`` from the fp32 masters before each forward, gradients cast to fp32 and unscaled."""
    torch.manual_seed(0)
    master = PipelineStage(layers, 0)
    compute = PipelineStage(layers, 0)
    compute.load_state_dict(master.state_dict())
    compute.to(dtype)
    opt = torch.optim.SGD(master.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for x, y in batches:
        with torch.no_grad():
            for pc, pm in zip(compute.parameters(), master.parameters()):
                pc.copy_(pm)
        loss = float_loss(compute(x), y)
        (loss * loss_scale).backward()
        for pc, pm in zip(compute.parameters(), master.parameters()):
            pm.grad = pc.grad.float() / loss_scale
            pc.grad = None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return master, losses


def _masters(model) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """This rank's fp32 master pieces: name -> [(flat start, values)]."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for bucket in state_of(model).buckets:
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            out.setdefault(names[id(bucket.params[piece.slot])], []).append((piece.start, view))
    return out


def _rms_over_world(pairs) -> float:
    sq = torch.tensor(
        [
            sum(((a - b).double() ** 2).sum().item() for a, b in pairs),
            sum(a.numel() for a, _ in pairs),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(sq)
    return (sq[0] / sq[1]).sqrt().item()


def _mixed_precision(rank, world_size):
    layout = zerokit.init_hybrid_parallel(2, 1, pp_degree=2)
    steps = 8
    batches = global_batches(steps, batch=8)
    layers = mp_layers()
    init, exact_params, exact_losses, _ = pipeline_reference(layers, batches, lm_loss)
    mine = slice(layout.dp_rank * 4, layout.dp_rank * 4 + 4)
    for dtype, level in ((torch.bfloat16, "p_g_os"), (torch.float16, "os_g")):
        what = f"dp2 x pp2 {dtype} level={level}"
        scaler = zerokit.ShardedGradScaler(init_scale=2.0**10) if dtype == torch.float16 else None
        ref, ref_losses = low_precision_reference(
            layers, batches, dtype, scaler.get_scale() if scaler else 1.0
        )
        pipe = PipelineModule(layers, float_loss, layout=layout, partition=[0, 3, 6])
        pipe.stage.load_state_dict({k: init[k] for k in pipe.stage.state_dict()})
        opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
        _, opt, scaler = zerokit.group_sharded_parallel(
            pipe.stage,
            opt,
            level,
            group=layout.dp_group,
            scaler=scaler,
            mixed_precision=zerokit.MixedPrecision(param_dtype=dtype),
        )
        losses = [
            pipe.train_batch((x[mine], y[mine]), opt, "1f1b", 2, scaler=scaler).item()
            for x, y in batches
        ]
        assert all(p.dtype == dtype for p in pipe.stage.parameters() if p.numel()), what
        # no farther from exact training than one process with the same policy (factor 4)
        loss_gap = max(abs(a - b) for a, b in zip(ref_losses, exact_losses))
        got = max(abs(a - b) for a, b in zip(losses, exact_losses))
        assert 0 < loss_gap and got <= 4 * loss_gap, f"{what}: loss {got}, one process {loss_gap}"
        pieces = [
            (v, exact_params[n].reshape(-1)[s : s + v.numel()])
            for n, ps in _masters(pipe.stage).items()
            for s, v in ps
        ]
        assert all(v.dtype == torch.float32 for v, _ in pieces), what
        got_rms = _rms_over_world(pieces)  # every element once: each stage's dp shards
        ref_rms = _rms_over_world(
            [(p.detach(), exact_params[n]) for n, p in ref.named_parameters()]
        )  # the same on every rank: the RMS of all of them
        assert got_rms <= 4 * ref_rms, f"{what}: masters rms {got_rms}, one process {ref_rms}"
        if scaler is None:
            continue
        # an inf in stage 0's gradients on rank 0 only: every rank of both stages skips
        before = {n: [v.clone() for _, v in ps] for n, ps in _masters(pipe.stage).items()}
        scale = scaler.get_scale()
        PLANT[0] = rank == 0
        x, y = batches[0]
        pipe.train_batch((x[mine], y[mine]), opt, "1f1b", 2, scaler=scaler)
        PLANT[0] = False
        for name, ps in _masters(pipe.stage).items():
            for b, (_, a) in zip(before[name], ps):
                assert torch.equal(b, a), f"{what}: rank {rank} stepped {name} on an inf"
        assert scaler.get_scale() == scale / 2, f"{what}: scale {scaler.get_scale()}"
        loss = pipe.train_batch((x[mine], y[mine]), opt, "1f1b", 2, scaler=scaler)
        assert torch.isfinite(loss), "training goes on"


@pytest.mark.slow
def test_dp2_pp2_mixed_precision_tracks_one_process():
    run_distributed(_mixed_precision, 4)


def _amp_scaler(rank, world_size):
    """Stages not wrapped, fp32, a torch.amp.GradScaler: a power-of-two scale divides out
    exactly, so training equals one process; an inf on stage 0 makes stage 1 skip too."""
    layers = mp_layers()
    batches = global_batches(3, batch=4)
    init, ref_state, ref_losses = reference_run(layers, batches, CLIP)
    pipe = PipelineModule(layers, lm_loss, num_stages=2, partition=[0, 3, 6])
    pipe.stage.load_state_dict({k: init[k] for k in pipe.stage.state_dict()})
    opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    losses = [
        pipe.train_batch(b, opt, "1f1b", 2, clip_norm=CLIP, scaler=scaler).item() for b in batches
    ]
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= ATOL, f"amp scaler: step {step}: {got} != {want}"
    for name, value in pipe.stage.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], atol=ATOL, rtol=0)
    before = {k: v.clone() for k, v in pipe.stage.state_dict().items()}
    scale = scaler.get_scale()
    PLANT[0] = rank == 0
    pipe.train_batch(batches[0], opt, "1f1b", 2, clip_norm=CLIP, scaler=scaler)
    PLANT[0] = False
    for name, value in pipe.stage.state_dict().items():
        assert torch.equal(value, before[name]), f"rank {rank} stepped {name} on an inf"
    assert scaler.get_scale() == scale / 2, scaler.get_scale()
    with pytest.raises(TypeError, match=r"torch\.amp\.GradScaler"):
        pipe.train_batch(batches[0], opt, scaler=zerokit.ShardedGradScaler())


def test_pp2_torch_grad_scaler_skips_on_every_stage():
    run_distributed(_amp_scaler, 2)
