"""``ep`` in the mesh: ``init_mesh(dp=, ep=)``, ``Strategy(ep=)`` (in code and in a strategy
file, as ``zerokit launch --strategy`` hands it to every rank) and ``init_expert_groups`` build
the same ep and expert-data-parallel groups, and ``parallelize`` over any of them trains as one
process holding the whole MoE on the global batch (AdamW, fp32, 2e-5). Bad combinations are
refused by name, before any communication."""

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from moe_models import assert_same_as_reference, batches, tiny_moe, train_ranks, train_reference
from torch.distributed.device_mesh import init_device_mesh

import zerokit
from zerokit.moe import ExpertParallelExperts, init_expert_groups
from zerokit.strategy import ENV


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _same_groups(rank, world, ep):
    """The layout's groups are ``init_expert_groups``'s: ep groups of neighbouring ranks."""
    layout = zerokit.init_mesh(dp=world, ep=ep)
    groups = init_expert_groups(ep)
    assert layout.ep_degree == ep
    assert _ranks(layout.ep_group) == _ranks(groups.ep_group)
    assert _ranks(layout.expert_dp_group) == _ranks(groups.expert_dp_group)
    first = rank - rank % ep
    assert _ranks(layout.ep_group) == list(range(first, first + ep))
    assert _ranks(layout.expert_dp_group) == list(range(rank % ep, world, ep))


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_init_mesh_ep_groups(world, ep):
    run_distributed(_same_groups, world, ep)


def _train(rank, world, way, tmp):
    """``way``: "mesh" (``init_mesh(ep=2)``), "strategy" (``Strategy(ep=2)``), "file" (a
    strategy file named by ``$ZEROKIT_STRATEGY``, as ``zerokit launch`` sets it)."""
    tokens = batches(3, 2 * world, constant_rows=1)
    model = tiny_moe("mixtral", aux=True)
    ref = tiny_moe("mixtral", aux=True)  # the same initial model
    want = train_reference(ref, tokens)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if way == "mesh":
        mesh = zerokit.init_mesh(dp=world, ep=2)
        config = zerokit.ShardingConfig(level="os_g", segment_size=10)
        model, opt = zerokit.parallelize(model, opt, mesh, config=config)
    elif way == "strategy":
        strategy = zerokit.Strategy(dp=world, ep=2, level="os_g", segment_size=10)
        model, opt = zerokit.parallelize(model, opt, strategy=strategy)
    else:
        path = os.path.join(tmp, "strategy.toml")
        if rank == 0:
            with open(path, "w") as f:
                f.write(f'dp = {world}\nep = 2\nlevel = "os_g"\nsegment_size = 10\n')
        dist.barrier()
        os.environ[ENV] = path
        model, opt = zerokit.parallelize(model, opt)
    split = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert split and all(m.groups.ep == 2 for m in split), f"{way}: experts not split"
    got = train_ranks(model, opt, tokens, rank, world)
    for g, w in zip(got, want):
        assert abs(g - w) <= 2e-5, (way, got, want)
    assert_same_as_reference(model, ref, 2e-5, f"parallelize by {way}, ep 2")


@pytest.mark.parametrize("way", ["mesh", "file"])
def test_parallelize_ep_by_mesh_and_by_file(way, tmp_path):
    run_distributed(_train, 2, way, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("way", ["mesh", "strategy", "file"])
def test_parallelize_ep_world4(way, tmp_path):
    run_distributed(_train, 4, way, str(tmp_path))


def test_bad_ep_refused_by_name_before_communication():
    """No process group here: each refusal comes before any collective."""
    cases = [
        ({"dp": 4, "ep": 3}, "ep = 3 must divide dp = 4"),
        ({"dp": 2, "tp": 2, "ep": 2}, "ep = 2 with tp = 2 is not supported yet"),
        ({"dp": 2, "pp": 2, "ep": 2}, "ep = 2 with pp = 2 is not supported yet"),
        ({"dp": 2, "shard": 2, "ep": 2}, "ep = 2 with shard = 2 is not supported yet"),
        ({"dp": 2, "ep": 0}, "ep must be an integer >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            zerokit.init_mesh(**kwargs)
        strategy_kwargs = {k: v for k, v in kwargs.items() if k != "shard"}
        if "shard" not in kwargs:  # the strategy refuses the same combination alike
            with pytest.raises(ValueError, match=message.replace("ep must", "Strategy.ep must")):
                zerokit.Strategy(**strategy_kwargs)


def _refusals(rank, world):
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    model = tiny_moe("mixtral")
    with pytest.raises(ValueError, match="DeviceMesh with an 'ep' dim is not read"):
        zerokit.parallelize(model, torch.optim.AdamW(model.parameters()), mesh)
    dense = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(dense.parameters())
    with pytest.raises(ValueError, match="has no experts module the plan knows"):
        zerokit.parallelize(dense, opt, zerokit.init_mesh(dp=2, ep=2))
    assert not hasattr(opt, "_zerokit"), "nothing is changed by a refused call"


def test_ep_mesh_refusals():
    run_distributed(_refusals, 2)
