"""Models built on meta: wrapped at every level, initialised bitwise as one process would,
trained as one process would; at 'p_g_os' materialised unit by unit; bad inputs refused on
every rank with the model left on meta."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import (
    SMALL,
    VOCAB,
    Awkward,
    assert_same_params,
    global_batches,
    loss_fn,
    make_optimizer,
    train_reference,
    train_sharded,
)
from torch import nn

import zerokit
from zerokit.models.gpt import GPT, GPTConfig


def awkward_init(m: nn.Module) -> None:
    """Every parameter and buffer of ``Awkward`` set, drawing from the generator in apply's
    order: a different order (parent first) gives different values."""
    if isinstance(m, nn.Linear | nn.Embedding):
        m.reset_parameters()
    if isinstance(m, Awkward):
        with torch.no_grad():
            m.tiny.fill_(0.9)
            m.odd.normal_(0, 0.1)
            m.unused.normal_()
            m.rare.normal_(0, 0.1)
            m.scale.fill_(0.5)


def reference(build, init, seed: int = 0) -> nn.Module:
    """The issue's one-process reference: seed, build, storage for every tensor on meta (as
    ``to_empty``, but ties kept, which ``to_empty`` breaks, and real buffers left alone),
    ``apply(init)``."""
    torch.manual_seed(seed)
    model = build()
    made: dict[int, torch.Tensor] = {}
    old = []  # the meta tensors stay alive, so their ids stay unique
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    old.append(t)
                    empty = torch.empty_like(t, device="cpu")
                    made[id(t)] = (
                        nn.Parameter(empty, t.requires_grad)
                        if table is module._parameters
                        else empty
                    )
                table[name] = made[id(t)]
    model.apply(init)
    return model


def on_meta_awkward() -> nn.Module:
    with torch.device("meta"):
        return Awkward()


def assert_bitwise(model: nn.Module, ref: nn.Module, what: str) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs from one process"


def _equal_to_one_process(rank: int, world_size: int) -> None:
    for level in zerokit.LEVELS:
        ref = reference(on_meta_awkward, awkward_init)
        torch.manual_seed(0)
        model = on_meta_awkward()
        opt = make_optimizer("adamw", model)  # two param groups, built over meta parameters
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, init_fn=awkward_init, **SMALL[level]
        )
        assert model.head.weight is model.emb.weight, "the tie was lost"
        assert opt.param_groups[1]["lr"] == 0.05 and opt.param_groups[1]["weight_decay"] == 0.05
        assert_bitwise(model, ref, f"{level} at init")
        batches = global_batches(3, 6)
        train_reference(ref, make_optimizer("adamw", ref), batches)
        train_sharded(model, opt, batches, rank, world_size)
        # 3e-5, not 2e-5: at world 3 one element of 42 ends 2.16e-5 from one process at every
        # level alike, with 'os''s all-reduce too (whole_grads=True): three ranks sum its
        # gradient in another order and AdamW (eps 1e-6) scales that rounding up
        assert_same_params(model, ref, 3e-5, f"{level} after 3 steps")


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_meta_model_equals_one_process_at_every_level(world_size):
    run_distributed(_equal_to_one_process, world_size)


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=8))


def _default_init_and_empty_init(rank: int, world_size: int) -> None:
    # init_fn=None: every module's reset_parameters(), in apply's order
    ref = reference(lambda: _meta(_gpt), zerokit.meta_init.reset_parameters, seed=3)
    torch.manual_seed(3)
    model = _meta(_gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    assert_bitwise(model, ref, "reset_parameters")

    # empty_init: parameters on meta, the buffer computed in __init__ kept
    def build() -> nn.Module:
        with zerokit.empty_init():
            return Awkward()

    ref = reference(build, _params_only_awkward)  # sets no buffer: scale (0.5) must survive
    torch.manual_seed(0)
    model = build()
    assert model.scale.device.type == "cpu" and model.emb.weight.is_meta
    opt = make_optimizer("sgd", model)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "p_g_os", init_fn=_params_only_awkward
    )
    assert float(model.scale) == 0.5, "empty_init's real buffer was lost"
    assert_bitwise(model, ref, "empty_init")
    batches = global_batches(2, 6)
    train_reference(ref, make_optimizer("sgd", ref), batches)
    train_sharded(model, opt, batches, rank, world_size)
    assert_same_params(model, ref, 2e-5, "empty_init after 2 steps")


def _params_only(m: Awkward) -> None:
    with torch.no_grad():
        m.tiny.fill_(0.9)
        m.odd.normal_(0, 0.1)
        m.unused.normal_()
        m.rare.normal_(0, 0.1)


def _params_only_awkward(m: nn.Module) -> None:
    if isinstance(m, Awkward):
        _params_only(m)
    elif isinstance(m, nn.Linear | nn.Embedding):
        m.reset_parameters()


def _meta(build):
    with torch.device("meta"):
        return build()


def test_default_init_and_empty_init():
    run_distributed(_default_init_and_empty_init, 3)


def test_empty_init_puts_parameters_on_meta_and_keeps_buffers():
    with zerokit.empty_init():
        bn = nn.BatchNorm1d(3)
        lin = nn.Linear(2, 2)
    assert bn.weight.is_meta and lin.weight.is_meta and lin.bias.is_meta
    assert bn.running_var.device.type == "cpu" and torch.equal(bn.running_var, torch.ones(3))
    assert nn.Linear(2, 2).weight.device.type == "cpu", "empty_init leaked past its block"


# -- memory while wrapping ---------------------------------------------------------------------
MIB = 2**20
DIM, BLOCKS = 1024, 8  # each block one 1024 x 1024 fp32 weight: a 4 MiB unit


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, DIM, bias=False)  # the root unit's 4 MiB

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _peak_while_wrapping(rank: int, world_size: int, out) -> None:
    # glibc's default malloc, untuned: its mmap threshold rises to the largest block freed,
    # as in any process that freed a big tensor before wrapping (this one: 32 MiB)
    freed = torch.ones(8 * MIB)
    del freed
    model = _meta(Tower)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from now
    zerokit.group_sharded_parallel(model, opt, "p_g_os")
    growth = torch.tensor([_status("VmHWM") - before], dtype=torch.float64)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put(float(growth))


@pytest.mark.parametrize("world_size", [2, 3])
def test_p_g_os_wraps_a_meta_model_holding_shards_plus_two_units(world_size):
    """A rank may hold, while wrapping: its shards of the whole model (36 MiB / N), the root
    unit (the head, 4 MiB: kept to the end) and the unit being initialised (4 MiB, in the
    walk's arena) whose shard is being copied, plus a fixed cost (gloo, the allocator: 8 MiB).
    Eager would hold the whole model (36 MiB) before wrapping even starts. Under glibc's
    default malloc, untuned, one allocation per unit grew 52.4 / 46.4 MiB at 2 / 3 ranks (the
    arena: 29.1 / 22.9)."""
    import multiprocessing as mp

    out = mp.get_context("fork").SimpleQueue()
    run_distributed(_peak_while_wrapping, world_size, out)
    growth = out.get()
    total = (BLOCKS + 1) * DIM * DIM * 4
    bound = total / world_size + 2 * DIM * DIM * 4 + 8 * MIB
    assert growth <= bound, f"peak grew {growth / MIB:.1f} MiB > bound {bound / MIB:.1f} MiB"
    assert bound < total, "the bound must be below what an eager model needs"


# -- an init_fn drawing from a generator seeded by the rank -----------------------------------
class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))  # two units
        self.proj = nn.Linear(4, 4).requires_grad_(False)  # frozen: held whole by every rank
        self.gain = nn.Parameter(torch.empty(4))  # the root unit's
        self.register_buffer("noise", torch.empty(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.proj(x) * self.gain + self.noise


def rank_seeded_init(generator: torch.Generator, into_units: bool = False):
    """Units' trainable weights from torch's generator (rank 0's on every rank), everything
    else, or also the units' with ``into_units``, from ``generator`` (seeded by the rank)."""

    def init(m: nn.Module) -> None:
        with torch.no_grad():
            if isinstance(m, nn.Linear) and m.weight.requires_grad and not into_units:
                m.reset_parameters()
            elif isinstance(m, nn.Linear):
                m.weight.normal_(generator=generator)
                m.bias.normal_(generator=generator)
            if isinstance(m, Frozen):
                m.gain.normal_(generator=generator)
                m.noise.normal_(generator=generator)

    return init


def _rank_seeded(rank: int, world_size: int) -> None:
    # one process is rank 0: its generator seeded with 0
    ref = reference(lambda: _meta(Frozen), rank_seeded_init(torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    model = _meta(Frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    init = rank_seeded_init(torch.Generator().manual_seed(rank))
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", init_fn=init)
    assert_bitwise(model, ref, f"rank {rank}")  # the same reference on every rank
    x = torch.ones(2, 4)
    loss = torch.tensor([float(model(x).sum())])
    losses = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(losses, loss)
    assert all(torch.equal(v, losses[0]) for v in losses), f"losses differ: {losses}"
    # drawing a unit's trainable weights by rank: each rank keeps only its shard of them, so
    # rank 0's values cannot be had; refused by name on every rank, the model left on meta
    model = _meta(Frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    init = rank_seeded_init(torch.Generator().manual_seed(rank), into_units=True)
    with pytest.raises(zerokit.MetaInitError, match=r"different values .*'blocks.0.weight'"):
        zerokit.group_sharded_parallel(model, opt, "p_g_os", init_fn=init)
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_seeded_init_fn_gives_one_model_on_every_rank(world_size):
    """Frozen parameters, the root unit's and buffers drawn by rank take rank 0's values (one
    process's); a unit's, of which ranks keep only shards, are refused by name."""
    run_distributed(_rank_seeded, world_size)


# -- bad inputs --------------------------------------------------------------------------------
def _bad_inputs(rank: int, world_size: int) -> None:
    def expect(error, match, model, opt, **kw):
        with pytest.raises(error, match=match):
            zerokit.group_sharded_parallel(model, opt, "p_g_os", **{**SMALL["p_g_os"], **kw})

    # half on meta: refused before anything is touched
    model = on_meta_awkward()
    model.tiny = nn.Parameter(torch.ones(1))
    expect(
        ValueError,
        "1 not .*tiny.*build the whole model under",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    # init_fn on a real model
    model = Awkward()
    expect(
        ValueError, "drop init_fn", model, torch.optim.SGD(model.parameters(), 0.1), init_fn=print
    )

    # init_fn raising on rank 1 only: the same error on every rank, the model still on meta
    def fails_on_rank_1(m):
        awkward_init(m)
        if rank == 1 and isinstance(m, nn.Sequential):
            raise RuntimeError("boom in init")

    torch.manual_seed(0)
    model = on_meta_awkward()
    opt = make_optimizer("adamw", model)
    params = dict(model.named_parameters())
    expect(
        zerokit.MetaInitError,
        "failed: rank 1: RuntimeError: boom in init",
        model,
        opt,
        init_fn=fails_on_rank_1,
    )
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert dict(model.named_parameters()) == params, "parameters were replaced"
    assert not isinstance(model, zerokit.core.module.ShardedModule) and not opt.state
    # ... and it can be wrapped afterwards, with the values one process gives
    ref = reference(on_meta_awkward, awkward_init)
    torch.manual_seed(0)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "p_g_os", init_fn=awkward_init, **SMALL["p_g_os"]
    )
    assert_bitwise(model, ref, "wrapped after a failed attempt")

    # init_fn leaving a parameter on meta (it replaced it)
    def replaces(m):
        awkward_init(m)
        if isinstance(m, nn.Sequential):
            m[0].weight = nn.Parameter(torch.empty(7, 6, device="meta"))

    model = on_meta_awkward()
    weight = model.block[0].weight
    expect(
        zerokit.MetaInitError, r"on meta \(\['block.0.weight'\]\)",
        model, make_optimizer("sgd", model), init_fn=replaces,
    )  # fmt: skip
    assert model.block[0].weight is weight and weight.is_meta, "the original was not put back"

    # a parent reaching into a unit already initialised and sharded
    def parent_reaches_in(m):
        awkward_init(m)
        if isinstance(m, Awkward):
            nn.init.zeros_(m.block[0].weight)

    model = on_meta_awkward()
    expect(
        zerokit.MetaInitError, r"init_fn\(<root>\) used a tensor on meta",
        model, make_optimizer("sgd", model), init_fn=parent_reaches_in,
    )  # fmt: skip


def test_bad_inputs_fail_on_every_rank_and_leave_the_model_on_meta():
    run_distributed(_bad_inputs, 2)


# -- tensor parallelism ------------------------------------------------------------------------
class TPNet(nn.Module):
    """Every tensor-parallel layer over ``layout``, and a plain one; no layout: the same model
    unsplit."""

    def __init__(self, layout=None):
        super().__init__()
        from zerokit import tensor_parallel as tp

        tensor_parallel = layout is not None

        self.emb = (
            tp.VocabParallelEmbedding(VOCAB, 8, layout=layout)
            if tensor_parallel
            else nn.Embedding(VOCAB, 8)
        )
        self.col = (
            tp.ColumnParallelLinear(8, 12, gather_output=False, layout=layout)
            if tensor_parallel
            else nn.Linear(8, 12)
        )
        self.row = (
            tp.RowParallelLinear(12, 8, input_is_parallel=True, layout=layout)
            if tensor_parallel
            else nn.Linear(12, 8)
        )
        self.out = nn.Linear(8, VOCAB)

    def forward(self, idx):
        return self.out(self.row(torch.relu(self.col(self.emb(idx)))))


def _tensor_parallel_on_meta(rank: int, world_size: int) -> None:
    layout = zerokit.init_hybrid_parallel(2, 2)
    torch.manual_seed(0)
    eager = TPNet(layout)  # today's construction: each tp rank keeps its slices of plain layers
    torch.manual_seed(0)
    model = _meta(lambda: TPNet(layout))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", group=layout.dp_group)
    assert_bitwise(model, eager, f"tp rank {layout.tp_rank}")


@pytest.mark.slow
def test_tensor_parallel_layers_on_meta_take_the_slices_of_eager_construction():
    run_distributed(_tensor_parallel_on_meta, 4)


# -- a pipeline stage built on meta --------------------------------------------------------------
def _pipeline_layers():
    from zerokit.pipeline import LayerDesc

    return (
        [LayerDesc(nn.Embedding, VOCAB, 8)]
        + [LayerDesc(nn.Linear, 8, 8) for _ in range(3)]
        + [LayerDesc(nn.Linear, 8, VOCAB)]
    )


def _pipeline_stage_on_meta(rank: int, world_size: int) -> None:
    from zerokit.pipeline import PipelineModule, PipelineStage

    layers = _pipeline_layers()
    torch.manual_seed(0)
    with torch.device("meta"):
        pipe = PipelineModule(layers, loss_fn, num_stages=2, partition=[0, 2, 5])
    start, end = pipe.bounds[rank], pipe.bounds[rank + 1]
    # the one-process reference of this stage: the same stage built on meta, then reset
    ref = reference(
        lambda: _meta(lambda: PipelineStage(layers[start:end], start)),
        zerokit.meta_init.reset_parameters,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    alone = dist.new_group([0]), dist.new_group([1])  # each stage's data-parallel group
    torch.manual_seed(0)
    pipe, opt, _ = zerokit.group_sharded_parallel(pipe, opt, "p_g_os", group=alone[rank])
    assert_bitwise(pipe.stage, ref, f"stage {rank}")
    x, y = global_batches(1, 4)[0]
    assert torch.isfinite(pipe.train_batch((x, y), opt, micro_batches=2))
    _pipeline_tied_on_meta()


def test_pipeline_stage_built_on_meta_wraps_at_p_g_os_and_tied_stages_are_refused():
    run_distributed(_pipeline_stage_on_meta, 2)


def _pipeline_tied_on_meta() -> None:
    from zerokit.pipeline import LayerDesc, PipelineModule, SharedLayerDesc

    layers = [SharedLayerDesc("emb", nn.Embedding, None, "weight", VOCAB, 8)]
    layers += [
        LayerDesc(nn.Linear, 8, 8),
        SharedLayerDesc("emb", nn.Embedding, None, "weight", VOCAB, 8),
    ]
    with pytest.raises(ValueError, match=r"\['emb'\] are tied across pipeline stages"):
        with torch.device("meta"):
            PipelineModule(layers, loss_fn, num_stages=2, partition=[0, 2, 3])


def _hybrid_and_mixed_precision(rank: int, world_size: int) -> None:
    layout = zerokit.init_hybrid_parallel(dp_degree=2, tp_degree=1, sharding_degree=2)
    ref = reference(on_meta_awkward, awkward_init)
    torch.manual_seed(rank)  # ranks seeded apart: every rank still draws rank 0's numbers
    model = on_meta_awkward()
    opt = make_optimizer("adamw", model)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "p_g_os", group=layout.sharding_group, dp_group=layout.dp_group,
        init_fn=awkward_init, **SMALL["p_g_os"],
    )  # fmt: skip
    full = model.state_dict()  # collective
    if rank == 0:  # seeded as the reference
        assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items()), "hybrid"
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {k: v.clone() for k, v in full.items()})
    for other in gathered:
        assert all(torch.equal(other[k], v) for k, v in full.items()), "ranks differ"

    # a failure on one rank reaches every rank of the grid (shard groups x replicas)
    def fails_on_rank_3(m):
        if rank == 3:
            raise RuntimeError("rank three")

    model = on_meta_awkward()
    with pytest.raises(zerokit.MetaInitError, match="rank 3: RuntimeError: rank three"):
        zerokit.group_sharded_parallel(
            model, make_optimizer("sgd", model), "p_g_os", group=layout.sharding_group,
            dp_group=layout.dp_group, init_fn=fails_on_rank_3,
        )  # fmt: skip
    # mixed precision: the fp32 masters hold the initial values exactly
    torch.manual_seed(0)
    model = on_meta_awkward()
    opt = make_optimizer("sgd", model)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "p_g_os", init_fn=awkward_init,
        mixed_precision=zerokit.MixedPrecision(param_dtype=torch.bfloat16), **SMALL["p_g_os"],
    )  # fmt: skip
    got = model.state_dict()
    for name, value in ref.state_dict().items():
        if name.startswith("frozen."):  # frozen parameters are cast to the compute dtype
            value = value.to(torch.bfloat16)
        assert torch.equal(got[name], value), f"mixed precision: {name}"


@pytest.mark.slow
def test_hybrid_sharding_and_mixed_precision_from_meta():
    run_distributed(_hybrid_and_mixed_precision, 4)
