"""Sequence parallelism and selective / full recomputation (Korthikanti et al.): the three
sequence mappings against the plain ops, the GPT against one process training the plain model
(losses, clipped gradient norms and parameters within 2e-5, fp32, dropout off, 10 steps), and
the activation bytes saved for backward (``memory.measure_activations``) against
``memory.estimate_activations``.
"""

import os

import pytest
import torch
from dist_helpers import run_distributed
from models import SMALL, global_batches, local_slice
from torch import nn

import zerokit
from zerokit import tensor_parallel as tp
from zerokit.memory import estimate_activations, measure_activations
from zerokit.models.gpt import GPT, GPTConfig, lm_loss

STEPS = 10
ATOL = 2e-5
VOCAB = 13
SEQ = 6  # divisible by tp 2


def _assert_close(got, want, what, atol=ATOL):
    torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


# -- the mappings ----------------------------------------------------------------------------
def _check_sequence_mappings(layout):
    group, r, n = layout.tp_group, layout.tp_rank, layout.tp_degree
    torch.manual_seed(0)
    full = torch.randn(4 * n, 2, 3)  # [s, b, h], the same on every rank
    weights = torch.randn(n, 4 * n, 2, 3)  # rank k's upstream gradient: weights[k]
    block = slice(4 * r, 4 * r + 4)

    x = full.clone().requires_grad_()
    y = tp.scatter_to_sequence_parallel_region(x, group)
    assert torch.equal(y, full[block])
    (y * weights[r, block]).sum().backward()  # all-gather: each block gets its rank's grad
    assert torch.equal(x.grad, torch.cat([weights[k, 4 * k : 4 * k + 4] for k in range(n)]))

    x = full[block].clone().requires_grad_()
    y = tp.gather_from_sequence_parallel_region(x, group)
    assert torch.equal(y, full)
    (y * weights[r]).sum().backward()  # reduce-scatter: the sum of every rank's grad, my block
    _assert_close(x.grad, weights.sum(0)[block], "gather_from_sequence backward")

    x = full[block].clone().requires_grad_()  # replicated layers follow: a whole gradient
    y = tp.gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False)
    (y * weights[0]).sum().backward()  # split: my block of it, nothing summed
    assert torch.equal(x.grad, weights[0, block])

    x = (full * (r + 1)).requires_grad_()  # a partial sum on each rank
    y = tp.reduce_scatter_to_sequence_parallel_region(x, group)
    _assert_close(y, (full * n * (n + 1) / 2)[block], "reduce_scatter forward")
    (y * weights[r, block]).sum().backward()  # all-gather backward
    assert torch.equal(x.grad, torch.cat([weights[k, 4 * k : 4 * k + 4] for k in range(n)]))

    uneven = torch.zeros(4 * n + 1, 2, 3)
    for fn in (
        tp.scatter_to_sequence_parallel_region,
        tp.reduce_scatter_to_sequence_parallel_region,
    ):
        with pytest.raises(ValueError, match=f"{4 * n + 1} is not divisible by {n}; pad"):
            fn(uneven, group)


def _check_layers_match_plain(layout):
    """Column(sp) -> gelu -> Row(sp) with biases on sequence blocks equals the plain pair."""
    _group, r, n = layout.tp_group, layout.tp_rank, layout.tp_degree
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    torch.manual_seed(3)
    sp = {"sequence_parallel": True, "layout": layout}
    col = tp.ColumnParallelLinear(8, 16, gather_output=False, **sp)
    row = tp.RowParallelLinear(16, 8, input_is_parallel=True, **sp)
    assert row.bias.sequence_parallel is True and not hasattr(col.bias, "sequence_parallel")
    model = nn.Sequential(col, nn.GELU(), row)
    torch.manual_seed(4)
    x = torch.randn(4 * n, 3, 8, requires_grad=True)  # [s, b, h]
    x_local = x.detach()[4 * r : 4 * r + 4].clone().requires_grad_()
    out, out_local = plain(x), model(x_local)  # [s, b, 8], [s/t, b, 8]
    _assert_close(out_local, out.detach()[4 * r : 4 * r + 4], "sp pair forward")
    upstream = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * upstream).sum().backward()
    (out_local * upstream[4 * r : 4 * r + 4]).sum().backward()
    _assert_close(x_local.grad, x.grad[4 * r : 4 * r + 4], "sp pair input grad")
    tp.allreduce_sequence_parallel_grads(model)
    _assert_close(row.bias.grad, plain[2].bias.grad, "row bias grad (summed over tp)")
    _assert_close(col.weight.grad, plain[0].weight.grad.chunk(n)[r], "column weight grad")
    _assert_close(col.bias.grad, plain[0].bias.grad.chunk(n)[r], "column bias grad")
    _assert_close(row.weight.grad, plain[2].weight.grad.chunk(n, dim=1)[r], "row weight grad")


# -- training --------------------------------------------------------------------------------
def _plain_config(explicit_attention: bool = False) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=6, n_embd=12,
                     explicit_attention=explicit_attention)  # fmt: skip


def _make_pair(layout, **options):
    """The plain model (the same attention arithmetic) and the tp model with ``options``."""
    cfg = _plain_config(options.get("explicit_attention", False))
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**cfg.__dict__, "tensor_parallel": True, **options}), layout)
    return ref, model


def _adamw(model):
    # lr 3e-3, not 1e-2: at 1e-2 this tiny GPT's training is chaotic from step 8 on, so fp32
    # rounding alone breaks 2e-5 (the one-process fp32 run's clipped grad norm is 1.3e-5 from
    # an fp64 run's at step 8, 2e-4 at step 10; tp2 and tp3 land 2.3e-5 and 3e-5 off). At 3e-3
    # fp32 stays within 3e-7 of fp64 over 12 steps, and 2e-5 is a bound with room to spare.
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)


def _check_training(layout, level: str | None, **options):
    what = f"tp={layout.tp_degree} dp={layout.dp_degree} level={level} {options}"
    ref, model = _make_pair(layout, sequence_parallel=True, **options)
    marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
    assert len(marked) == 4 * 2 + 2, f"{what}: marked {marked}"  # ln_1, ln_2 per block; ln_f
    ref_opt, opt = _adamw(ref), _adamw(model)
    if level is not None:
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, group=layout.dp_group, **SMALL[level]
        )
    loss_fn = tp.ParallelCrossEntropy(layout=layout)
    dp_rank, dp = layout.dp_rank, layout.dp_degree
    for step, (x, y) in enumerate(global_batches(STEPS, 4 * dp, seq=SEQ, vocab=VOCAB)):
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(model(local_slice(x, dp_rank, dp)), local_slice(y, dp_rank, dp))
        loss.backward()
        if level is None:  # wrapped: ZeRO sums the marked gradients over tp itself
            tp.allreduce_sequence_parallel_grads(model)
        norm = zerokit.clip_grad_norm_(model, 0.3)
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss, group=layout.dp_group)
        _assert_close(loss / dp, ref_loss.detach(), f"{what}: step {step} loss")
        _assert_close(norm, ref_norm, f"{what}: step {step} grad norm")
    got, want = tp.gather_full_state_dict(model), ref.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        _assert_close(got[key], want[key], f"{what}: trained {key}")
    if level is not None:
        with pytest.raises(RuntimeError, match="would double them"):
            tp.allreduce_sequence_parallel_grads(model)


def _check_recompute_replays_dropout(layout):
    """With dropout on, recomputation redraws the very masks of forward (the tracker's local
    and global streams are rewound), so the gradients equal those of storing everything."""
    grads = {}
    for recompute in (None, "selective", "full"):
        _, model = _make_pair(
            layout,
            sequence_parallel=True,
            explicit_attention=True,
            dropout=0.3,
            recompute=recompute,
        )
        tp.model_parallel_random_seed(11, layout)
        x, y = global_batches(1, 4, seq=SEQ, vocab=VOCAB)[0]
        tp.ParallelCrossEntropy(layout=layout)(model(x), y).backward()
        grads[recompute] = [p.grad for p in model.parameters()]
    for recompute in ("selective", "full"):
        for got, want in zip(grads[recompute], grads[None]):
            _assert_close(got, want, f"recompute={recompute} with dropout", atol=1e-6)


def _tp2(rank, world_size):
    layout = zerokit.init_hybrid_parallel(1, 2)
    _check_sequence_mappings(layout)
    _check_layers_match_plain(layout)
    _check_training(layout, None)
    _check_training(layout, None, recompute="selective")
    _check_training(layout, None, recompute="full", explicit_attention=True)
    _check_recompute_replays_dropout(layout)
    _, model = _make_pair(layout, sequence_parallel=True)
    with pytest.raises(ValueError, match="7 is not divisible by 2"):
        model(torch.zeros(2, 7, dtype=torch.long))


def test_tp2_sequence_parallel_and_recompute_match_one_process():
    run_distributed(_tp2, 2)


def _tp3(rank, world_size):
    layout = zerokit.init_hybrid_parallel(1, 3)
    assert SEQ % 3 == 0 and _plain_config().n_head % 3 == 0  # [T/3, B, C] blocks, 2 heads
    _check_training(layout, None)
    _check_training(layout, None, recompute="selective", explicit_attention=True)


def test_tp3_sequence_parallel_matches_one_process():
    run_distributed(_tp3, 3)


# -- a checkpoint of the sequence-parallel GPT, into one process ------------------------------
def _save_sequence_parallel(rank, world_size, root):
    layout = zerokit.init_hybrid_parallel(1, 2)
    _, model = _make_pair(layout, sequence_parallel=True)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, _adamw(model), "p_g_os", group=layout.dp_group, **SMALL["p_g_os"]
    )
    loss_fn = tp.ParallelCrossEntropy(layout=layout)
    for x, y in global_batches(3, 4, seq=SEQ, vocab=VOCAB):  # trained, so not the initial state
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    zerokit.checkpoint.save(os.path.join(root, "ckpt"), model, opt)
    full = tp.gather_full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(root, "gathered.pt"))


def test_sequence_parallel_checkpoint_loads_into_one_plain_process(tmp_path):
    """tp2 with sequence_parallel=True at 'p_g_os', saved; loaded into the plain GPT (tp 1) in
    this process, without a process group: each parameter equals gather_full_state_dict's,
    the sequence-parallel LayerNorms (held whole on both tp ranks) included."""
    run_distributed(_save_sequence_parallel, 2, str(tmp_path))
    want = torch.load(tmp_path / "gathered.pt", weights_only=True)
    torch.manual_seed(123)  # another initialisation: everything must come from the load
    plain = GPT(_plain_config())
    opt = _adamw(plain)
    zerokit.checkpoint.load(tmp_path / "ckpt", plain, opt)
    got = plain.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert all(len(opt.state[p]) for p in plain.parameters())  # the optimizer state came too


def _dp2_x_tp2(rank, world_size):
    layout = zerokit.init_hybrid_parallel(2, 2)
    for level in zerokit.LEVELS:
        _check_training(layout, level)
    _check_training(layout, "os_g", recompute="selective")


@pytest.mark.slow
def test_dp2_x_tp2_sequence_parallel_every_level_matches_one_process():
    run_distributed(_dp2_x_tp2, 4)


def test_config_errors():
    with pytest.raises(ValueError, match="needs tensor_parallel=True"):
        GPTConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="recompute must be"):
        GPTConfig(recompute="some")
    with pytest.raises(ValueError, match="needs tp > 1"):
        estimate_activations(8, 1, 8, 2, 1, tp=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="recompute must be one of"):
        estimate_activations(8, 1, 8, 2, 1, recompute="partial")
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        estimate_activations(8, 1, 8, 0, 1)


# -- measured activations against the formulas -----------------------------------------------
# s, b, h, a chosen so every term of the formula is sizeable: 5as/h = 10 (attention core) next
# to 34 (the rest); what the formula leaves out (LayerNorm means and inverse deviations,
# [s, b, 1] each, 4 per layer: 4 * 4 bytes per sbh/h) is 16/h of sbh, 0.5% here.
S, B, H, A, LAYERS = 32, 2, 64, 4, 2
SETTINGS = {  # name -> (GPT options, estimate options)
    "none": ({}, {"tp": 1}),
    "tp": ({"tensor_parallel": True}, {"tp": 2}),
    "tp+sp": (
        {"tensor_parallel": True, "sequence_parallel": True},
        {"tp": 2, "sequence_parallel": True},
    ),
    "tp+sp+selective": (
        {"tensor_parallel": True, "sequence_parallel": True, "recompute": "selective"},
        {"tp": 2, "sequence_parallel": True, "recompute": "selective"},
    ),
    "full": ({"tensor_parallel": True, "recompute": "full"}, {"tp": 2, "recompute": "full"}),
}


def _measure(rank, world_size):
    layout = zerokit.init_hybrid_parallel(1, 2)
    tp.model_parallel_random_seed(7, layout)
    for name, (options, estimate_options) in SETTINGS.items():
        cfg = GPTConfig(vocab_size=16, block_size=S, n_layer=LAYERS, n_head=A, n_embd=H,
                        explicit_attention=True, dropout=0.1, **options)  # fmt: skip
        got = measure_activations(GPT(cfg, layout), torch.randint(0, 16, (B, S)))
        assert got.layers == LAYERS
        measured = got.per_layer_bytes
        want = estimate_activations(S, B, H, A, LAYERS, bytes_per_value=4, **estimate_options)
        ratio = measured / want.per_layer_bytes
        if rank == 0:
            print(f"{name}: measured {measured:.0f} B/layer, estimated "
                  f"{want.per_layer_bytes:.0f} ({ratio:.3f})")  # fmt: skip
        # Within 10% as asked, and tighter: the LayerNorm statistics are the only bytes the
        # formula leaves out, 0.25 sbh against >= 33 sbh (fp32): < 1%; 2% leaves room for noise.
        assert 1.0 <= ratio < 1.02, f"{name}: measured {measured} vs estimated {want}"


def test_measured_activations_match_the_estimate():
    run_distributed(_measure, 2)
