"""Small habits of existing training loops (issue 22), each compared with one process training
the same global batch over several steps (2e-5, fp32): a disabled ``torch.amp.GradScaler``
(nanoGPT's ``enabled=(dtype == 'float16')``), a tied head called per chunk with a backward each
(chunked cross-entropy), ``memory.estimate`` of a model already wrapped, wrapping a
``PipelineModule`` itself, and DDP's ``require_backward_grad_sync`` switch (HF accelerate,
Lightning) beside ``no_sync()`` for gradient accumulation."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_distributed
from models import (
    SMALL,
    VOCAB,
    assert_same_params,
    global_batches,
    local_slice,
    loss_fn,
    pipeline_reference,
    reference_pair,
    train_reference,
    train_sharded,
)
from torch import nn

import zerokit
from zerokit.memory import ESTIMATE_LEVELS, estimate
from zerokit.pipeline import LayerDesc, PipelineModule

ATOL = 2e-5
STEPS = 4


# -- 1. a disabled torch GradScaler ---------------------------------------------------------------
def _disabled_scaler(rank, world_size):
    batches = global_batches(STEPS, batch=2 * world_size)
    for level, in_backward in (("os", False), ("os_g", False), ("p_g_os", False), ("os_g", True)):
        what = f"disabled GradScaler level={level} step_in_backward={in_backward}"
        (ref, ref_opt), (model, opt) = reference_pair("awkward", "adamw")
        train_reference(ref, ref_opt, batches)
        model, opt, scaler = zerokit.group_sharded_parallel(
            model,
            opt,
            level,
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            step_in_backward=in_backward,
            **SMALL[level],
        )
        assert not scaler.is_enabled() and scaler.get_scale() == 1.0, what
        loss = torch.ones(())
        assert scaler.scale(loss) is loss, f"{what}: a disabled scaler scales nothing"
        train_sharded(model, opt, batches, rank, world_size, scaler=scaler)
        assert_same_params(model, ref, ATOL, what)


def test_disabled_torch_grad_scaler_trains_unscaled():
    run_distributed(_disabled_scaler, 2)


# -- 2. a tied head called per chunk, a backward per chunk -----------------------------------------
class TiedTrunk(nn.Module):
    """forward returns the hidden state; the head, tied to the embedding, is called by the
    training loop on chunks of it (as chunked cross-entropy does)."""

    def __init__(self):
        super().__init__()
        dim = 6
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, idx):  # [B, T] -> [B, T, dim]
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.ln_f(x)


def chunked_step(model, x, y, chunks: int, detach: bool, tokens: int) -> None:
    """The loss summed over ``tokens`` (the global batch's), one backward per chunk of the
    sequence. ``detach``: the head's backwards stop at a detached hidden state whose gradient
    then goes through the trunk once; otherwise every chunk's backward runs through the trunk
    (retain_graph)."""
    h = model(x)
    head_in = h.detach().requires_grad_() if detach else h
    for hc, yc in zip(head_in.chunk(chunks, dim=1), y.chunk(chunks, dim=1)):
        logits = model.lm_head(hc)  # outside the model's forward: [B, T/chunks, vocab]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), yc.reshape(-1), reduction="sum")
        (loss / tokens).backward(retain_graph=not detach)
    if detach:
        h.backward(head_in.grad)


def _chunked_head(rank, world_size, levels, segment_sizes=(10,)):
    """``segment_size=10``: the embedding, the head and ln_f are units too, and the tied weight,
    shared between two units, is the root unit's; the default: ln_f and the tied weight are the
    root unit's, the head no unit of its own."""
    batches = global_batches(STEPS, batch=2 * world_size, seq=6)
    tokens = batches[0][1].numel()  # one process: the mean over the global batch's tokens
    for level, segment_size, detach in itertools.product(levels, segment_sizes, (True, False)):
        what = (
            f"chunked head level={level} segment_size={segment_size} detach={detach} "
            f"world_size={world_size}"
        )
        torch.manual_seed(0)
        ref = TiedTrunk()
        model = copy.deepcopy(ref)
        # SGD, not Adam: Adam's update hardly sees the gradient's scale, which must be right
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=segment_size)
        for x, y in batches:
            chunked_step(ref, x, y, 3, detach, tokens)
            ref_opt.step()
            ref_opt.zero_grad()
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            # the mean over this rank's tokens: the ranks' gradients are averaged
            chunked_step(model, xs, ys, 3, detach, tokens // world_size)
            opt.step()
            opt.zero_grad()
        assert_same_params(model, ref, ATOL, what)


def test_tied_head_per_chunk_every_level():
    run_distributed(_chunked_head, 2, ("os", "os_g", "p_g_os"))


def test_tied_head_per_chunk_stage3_world_size_3():
    run_distributed(_chunked_head, 3, ("p_g_os",), (10, 2**20))


# -- 3. memory.estimate of a wrapped model ---------------------------------------------------------
def _estimate_wrapped(rank, world_size):
    layout = zerokit.init_hybrid_parallel(2, 1, sharding_degree=2)
    for level, hybrid in (("os", False), ("os_g", False), ("p_g_os", False), ("p_g_os", True)):
        what = f"estimate of a model wrapped at {level}{' (hybrid)' if hybrid else ''}"
        (plain, _), (model, opt) = reference_pair("gpt", "adamw")
        groups = {"group": layout.sharding_group, "dp_group": layout.dp_group} if hybrid else {}
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **groups)
        for asked in ESTIMATE_LEVELS:
            for n in (2, 3):
                got, want = estimate(model, asked, n), estimate(plain, asked, n)
                assert want.total > 0
                assert got == want, f"{what}, asked {asked} at {n} ranks: {got} != {want}"


def test_estimate_of_a_wrapped_model_counts_its_parameters():
    run_distributed(_estimate_wrapped, 4)


# -- 4. wrapping a PipelineModule ----------------------------------------------------------------
def _pipeline_layers():
    return [
        LayerDesc(nn.Embedding, VOCAB, 6),
        LayerDesc(nn.Linear, 6, 6),
        torch.tanh,
        LayerDesc(nn.Linear, 6, VOCAB),
    ]


def _wrap_pipe(rank, world_size, pp, levels):
    layout = zerokit.init_hybrid_parallel(world_size // pp, 1, pp_degree=pp)
    layers = _pipeline_layers()
    batches = global_batches(STEPS, batch=4 * layout.dp_degree)
    init, ref_state, ref_losses, _ = pipeline_reference(layers, batches)
    per = len(batches[0][0]) // layout.dp_degree
    mine = slice(layout.dp_rank * per, (layout.dp_rank + 1) * per)
    for level in levels:
        what = f"group_sharded_parallel(pipe) pp={pp} dp={layout.dp_degree} level={level}"
        pipe = PipelineModule(layers, loss_fn, layout=layout, partition="uniform")
        pipe.stage.load_state_dict({k: init[k] for k in pipe.stage.state_dict()})
        opt = torch.optim.SGD(pipe.parameters(), lr=0.2, momentum=0.9)  # as pipeline_reference
        wrapped, opt, _ = zerokit.group_sharded_parallel(pipe, opt, level, group=layout.dp_group)
        assert wrapped is pipe, what
        losses = [pipe.train_batch((x[mine], y[mine]), opt, "1f1b", 2).item() for x, y in batches]
        torch.testing.assert_close(losses, ref_losses, atol=ATOL, rtol=0, msg=what)
        for name, value in pipe.stage.state_dict().items():
            torch.testing.assert_close(
                value, ref_state[name], atol=ATOL, rtol=0, msg=f"{what}: {name}"
            )


def test_wrap_pipeline_module_itself():
    run_distributed(_wrap_pipe, 2, 1, ("os", "os_g", "p_g_os"))


@pytest.mark.slow
def test_wrap_pipeline_module_itself_dp2_pp2():
    run_distributed(_wrap_pipe, 4, 2, ("os_g", "p_g_os"))


# -- 5. DDP's require_backward_grad_sync and no_sync() ---------------------------------------------
def _accumulate(model, opt, batches, micro: int, switch: str | None, shard=None) -> None:
    """``micro`` micro-batches a step; all but the last without gradient sync, through
    ``switch``: 'attribute' (``model.require_backward_grad_sync = False``, as HF accelerate
    and Lightning do on DDP models), 'no_sync' (``with model.no_sync():``), None (one
    process)."""
    for x, y in batches:
        if shard is not None:
            x, y = local_slice(x, *shard), local_slice(y, *shard)
        for m, (mx, my) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            sync = m == micro - 1
            if switch == "attribute":
                model.require_backward_grad_sync = sync
            if switch == "no_sync" and not sync:
                with model.no_sync():
                    assert model.require_backward_grad_sync is False  # as DDP's no_sync sets
                    (loss_fn(model(mx), my) / micro).backward()
            else:
                (loss_fn(model(mx), my) / micro).backward()
        opt.step()
        opt.zero_grad()


def _grad_sync_switches(rank, world_size):
    for level in ("os", "os_g", "p_g_os"):
        # the switch really withholds the reduction: the step refuses unreduced gradients
        _, (model, opt) = reference_pair("awkward", "adamw")
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
        ((x, y),) = global_batches(1, batch=2)
        model.require_backward_grad_sync = False
        loss_fn(model(x), y).backward()
        model.require_backward_grad_sync = True
        with pytest.raises(RuntimeError, match="never reduced"):
            opt.step()
        for switch, micro in (("attribute", 2), ("attribute", 4), ("no_sync", 3)):
            what = f"{switch} micro={micro} level={level} world_size={world_size}"
            batches = global_batches(STEPS, batch=micro * 2 * world_size, seed=micro)
            (ref, ref_opt), (model, opt) = reference_pair("awkward", "adamw")
            _accumulate(ref, ref_opt, batches, micro, None)
            model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
            assert model.require_backward_grad_sync is True, what
            _accumulate(model, opt, batches, micro, switch, shard=(rank, world_size))
            assert model.require_backward_grad_sync is True, what
            assert_same_params(model, ref, ATOL, what)


@pytest.mark.parametrize("world_size", [2, 3])
def test_require_backward_grad_sync_and_no_sync_accumulate(world_size):
    run_distributed(_grad_sync_switches, world_size)


# -- 6. model.zero_grad() instead of the optimizer's ---------------------------------------------
def _model_zero_grad(rank, world_size):
    """DDP loops (and transformers' Trainer) clear gradients with ``model.zero_grad()``: it must
    clear zerokit's gradient buffers as ``opt.zero_grad()`` does, both ways of clearing, with
    one optimizer and with two (the model's call clears every one's gradients)."""
    batches = global_batches(STEPS, batch=2 * world_size)
    for level, set_to_none, two in itertools.product(
        ("os", "os_g", "p_g_os"), (True, False), (False, True)
    ):
        what = f"model.zero_grad(set_to_none={set_to_none}) level={level} two optimizers={two}"
        (ref, ref_opt), (model, opt) = reference_pair("awkward", "adamw")
        for x, y in batches:  # one process clears the same way (a zero gradient is stepped)
            loss_fn(ref(x), y).backward()
            ref_opt.step()
            ref.zero_grad(set_to_none=set_to_none)
        if two:  # make_optimizer's two param groups as two optimizers: the same update
            opt = [torch.optim.AdamW(**group, eps=1e-6) for group in _groups_as_kwargs(opt)]
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
        opts = opt if isinstance(opt, list) else [opt]
        for x, y in batches:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            loss_fn(model(x), y).backward()
            for o in opts:
                o.step()
            model.zero_grad(set_to_none=set_to_none)
        assert_same_params(model, ref, ATOL, what)


def _groups_as_kwargs(opt) -> list[dict]:
    keys = ("params", "lr", "weight_decay")
    return [{k: group[k] for k in keys} for group in opt.param_groups]


@pytest.mark.parametrize("world_size", [2])
def test_model_zero_grad_clears_the_sharded_gradients(world_size):
    run_distributed(_model_zero_grad, world_size)
