"""Issue 42, items 4-8: what a second look found silent (a setting that lost, unwrap's
low-bit states, Muon's owner balance, ``parallelize`` under torchrun, ``ckpt convert``'s
paths and note). Each test failed on the code before its fix."""

from __future__ import annotations

import itertools
import json
import textwrap

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed, run_torchrun
from models import make_model, make_optimizer
from torch import nn

import zerokit
from zerokit import ShardingConfig, Strategy
from zerokit.config import merge_arguments

# --- item 4: a setting given twice is compared, whatever its value ---------------------------


@pytest.mark.parametrize(
    "config, argument",
    [
        (ShardingConfig(offload=True), {"offload": False}),  # the default given explicitly
        (ShardingConfig(offload=False), {"offload": True}),  # the default held explicitly
        (ShardingConfig(buffer_max_size=2**23), {"buffer_max_size": 100}),
        (ShardingConfig(sync_comm=True), {"sync_comm": False}),
    ],
)
def test_a_default_value_given_twice_is_compared(config, argument):
    (name,) = argument
    with pytest.raises(ValueError, match=f"{name} is given twice, as an argument .* in config"):
        merge_arguments(config, **argument)


def test_the_same_value_twice_passes_and_none_is_not_given():
    assert merge_arguments(ShardingConfig(offload=True), offload=True).offload is True
    assert merge_arguments(ShardingConfig(offload=True), offload=None).offload is True
    assert merge_arguments(ShardingConfig(), offload=True).offload is True  # default: not given
    assert merge_arguments(ShardingConfig(level=2), level="os_g").level == "os_g"
    # a merged config remembers what it was given: a third source is compared with it
    merged = merge_arguments(ShardingConfig(), sync_comm=False)
    with pytest.raises(ValueError, match="sync_comm is given twice"):
        merge_arguments(merged, sync_comm=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # the case: the strategy's level is its default, given explicitly
        (
            {"config": ShardingConfig(level="os"), "strategy": Strategy(level="p_g_os")},
            r"level is given twice, as the strategy \('p_g_os'\) and in config \('os'\)",
        ),
        (
            {"level": "os", "strategy": Strategy(level="p_g_os")},
            r"level is given twice, as level= \('os'\) and by the strategy \('p_g_os'\)",
        ),
        (
            {"config": ShardingConfig(offload=True), "strategy": Strategy(offload=False)},
            "offload is given twice, as the strategy",
        ),
        (
            {"micro_batches": 2, "strategy": Strategy(micro_batches=1)},
            r"micro_batches is given twice, as micro_batches= \(2\) and by the strategy \(1\)",
        ),
    ],
)
def test_parallelize_refuses_a_setting_given_twice(kwargs, match):
    model = make_model("awkward")
    with pytest.raises(ValueError, match=match):
        zerokit.parallelize(model, make_optimizer("sgd", model), **kwargs)


def test_parallelize_takes_what_one_source_gives():
    from zerokit.parallelize import _one_config

    # a strategy that gives no level leaves the config's; one that gives it, the same, passes
    assert _one_config(ShardingConfig(level="os"), Strategy(), None).level == "os"
    assert _one_config(ShardingConfig(level="os"), Strategy(level=1), "os").level == "os"
    assert _one_config(None, Strategy(), None).level == Strategy().level


def _gsp_refuses_explicit_default(rank, world_size):
    model = make_model("awkward")
    with pytest.raises(ValueError, match="offload is given twice"):
        zerokit.group_sharded_parallel(
            model, make_optimizer("sgd", model), "os", offload=False,
            config=ShardingConfig(offload=True),
        )  # fmt: skip
    assert zerokit.core.state.state_of(model) is None  # nothing was built


def test_group_sharded_parallel_refuses_an_explicit_default_against_its_config():
    run_distributed(_gsp_refuses_explicit_default, 1)


# --- item 7: parallelize under torchrun without init_process_group ---------------------------

TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import copy, sys
    import torch, torch.distributed as dist, zerokit
    from torch import nn

    level = None if sys.argv[1] in ("default", "strategy") else sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    # no dist.init_process_group(): parallelize makes it from torchrun's environment
    model, opt = zerokit.parallelize(model, opt, level=level)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        torch.nn.functional.mse_loss(reference(x), torch.zeros(4, 2)).backward()
        ref_opt.step(); ref_opt.zero_grad()
        mine = x.chunk(world)[rank]
        torch.nn.functional.mse_loss(model(mine), torch.zeros(len(mine), 2)).backward()
        opt.step(); opt.zero_grad()
    zerokit.unwrap(model, opt)
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    print(f"rank {rank} world {world} gap {gap:.1e}")
    assert gap < 1e-5, gap
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["default", "os", "strategy"])
def test_parallelize_under_torchrun_makes_its_process_group(tmp_path, monkeypatch, level):
    """The same rule as ``group_sharded_parallel``: launched ranks without
    ``init_process_group`` train as the 2-rank world they are, equal to one process (with no
    level, a level, or a strategy file as ``zerokit launch --strategy`` hands it on)."""
    if level == "strategy":
        (tmp_path / "strategy.toml").write_text('dp = 2\nlevel = "os_g"\n')
        monkeypatch.setenv("ZEROKIT_STRATEGY", str(tmp_path / "strategy.toml"))
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = run_torchrun(script, 2, level, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} world 2" in done.stdout, done.stdout


def test_every_entry_point_refuses_the_same_way_without_a_launcher(monkeypatch):
    from zerokit.runtime.world import LAUNCHER_ENV

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    model = make_model("awkward")
    for call, who in [
        (lambda: zerokit.parallelize(model, make_optimizer("sgd", model)), "parallelize"),
        (lambda: zerokit.init_mesh(dp=1), "init_hybrid_parallel"),
        (lambda: zerokit.group_sharded_parallel(model, make_optimizer("sgd", model), "os"),
         "group_sharded_parallel"),
    ]:  # fmt: skip
        with pytest.raises(RuntimeError, match=f"{who} found no torch.distributed process group"):
            call()


# --- item 8: ckpt convert makes its output's parents, and --to hf notes a missing config -----


@pytest.fixture
def saved_checkpoint(tmp_path):
    from zerokit import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "ckpt", model, opt)
    return tmp_path / "ckpt", model


@pytest.mark.parametrize("to", ["zerokit", "dcp", "hf"])
def test_convert_makes_missing_parents_as_save_does(saved_checkpoint, tmp_path, capsys, to):
    from zerokit.tools.cli import main as cli

    path, model = saved_checkpoint
    output = tmp_path / "not" / "yet" / "there"
    assert cli(["ckpt", "convert", str(path), str(output), "--to", to]) == 0, capsys.readouterr()
    if to == "hf":
        from safetensors.torch import load_file

        written = load_file(output / "model.safetensors")
        for name, value in model.state_dict().items():
            assert torch.equal(written[name], value), name
    else:  # complete and verified as a checkpoint of its format
        assert cli(["ckpt", "inspect", str(output)]) == 0, capsys.readouterr()
    assert not [p for p in output.parent.iterdir() if ".zerokit-tmp-" in p.name]


def test_convert_to_hf_without_a_config_says_so(saved_checkpoint, tmp_path, capsys):
    from zerokit.tools.cli import main as cli

    path, _ = saved_checkpoint
    output = tmp_path / "hf"
    assert cli(["ckpt", "convert", str(path), str(output), "--to", "hf"]) == 0
    out = capsys.readouterr().out
    assert f"note: {output} has no config.json" in out and "from_pretrained" in out, out
    assert not (output / "config.json").exists()


# --- item 6: Muon's owners balanced over the whole model ------------------------------------

#: widths of a chain of 11 matrices (matrix i is CHAIN[i + 1] x CHAIN[i]) of very uneven
#: Newton-Schulz cost, the costliest last: owners chosen one unit at a time in model order put
#: 1.65x the mean on one rank at world 3; chosen costliest first, 1.01x
CHAIN = (64, 16, 32, 32, 8, 16, 48, 16, 40, 8, 32, 48)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        pairs = itertools.pairwise(CHAIN)
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in pairs)

    def forward(self, x):  # [batch, CHAIN[0]] -> [batch, CHAIN[-1]]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def uneven_chain():
    """``zerokit plan --model test_second_look:uneven_chain``: the chain and its batches."""
    torch.manual_seed(0)

    def make_batch(step: int, batch: int):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch, CHAIN[0], generator=g), torch.randn(batch, CHAIN[-1], generator=g)

    return Chain(), make_batch


def _bound(costs: list[float], world: int) -> float:
    """What the owners may put on the slowest rank: 1.15x a perfect split, or the largest
    matrix when it alone is more (no split can do better then)."""
    return max(1.15 * sum(costs) / world, max(costs))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_owners_of_an_uneven_chain_are_balanced_over_the_whole_model(world):
    from zerokit.core import muon_cost, needs_of, plan_groups, plan_units

    model = Chain()
    muon = torch.optim.Muon(model.parameters(), lr=0.02)
    needs = needs_of([muon])
    costs = [muon_cost(tuple(p.shape)) for p in model.parameters()]
    named = list(model.named_parameters())
    plans = plan_units(model, named, segment_size=2**20)  # one unit per matrix, as at 'p_g_os'
    assert len(plans) >= len(costs)
    loads = [0.0] * world
    for _, layouts in plan_groups(plans, world, 2**23, needs=needs):
        for layout in layouts:
            for rank in range(world):
                for piece in layout.pieces(rank):
                    slot = layout.slots[piece.slot]
                    assert slot.whole and piece.numel == slot.numel  # owned whole
                    loads[rank] += muon_cost(slot.shape)
    assert sum(loads) == sum(costs)
    assert max(loads) <= _bound(costs, world), (loads, sum(costs) / world)


@pytest.mark.parametrize("level", ["os", "os_g", "p_g_os"])
def test_plan_shows_the_balanced_owners(level, capsys, tmp_path):
    from zerokit.core import muon_cost
    from zerokit.tools import cli

    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "test_second_look:uneven_chain", "--world", "3", "--level", level]
    assert cli.main([*argv, "--optimizer", "muon", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    flops = [r["optimizer_flops"] for r in report["ranks"]]
    costs = [muon_cost(tuple(p.shape)) for p in Chain().parameters()]
    # the plan counts 2 x 5 Newton-Schulz iterations per cost unit
    assert sum(flops) == 10 * sum(costs)
    assert max(flops) <= 10 * _bound(costs, 3), flops
    assert f"imbalance (max / mean over ranks): {report['optimizer_flops_imbalance']:.3f}" in out
    assert report["optimizer_flops_imbalance"] <= 1.15, flops


def _chain_trains_as_one_process(rank, world):
    import copy

    from zerokit.tools.plan_optimizers import newton_schulz_in_fp32

    newton_schulz_in_fp32()  # a last-bit difference stays one: tells a sharding error apart
    model, make_batch = uneven_chain()
    reference = copy.deepcopy(model)
    opt = torch.optim.Muon(model.parameters(), lr=0.02, momentum=0.95)
    ref_opt = torch.optim.Muon(reference.parameters(), lr=0.02, momentum=0.95)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    for step in range(4):
        x, y = make_batch(step, 6)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * 6 // world, (rank + 1) * 6 // world)
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    zerokit.unwrap(model, opt)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_the_uneven_chain_trains_as_one_process_at_p_g_os(world):
    run_distributed(_chain_trains_as_one_process, world)


# --- item 5: unwrap gives back torchao's low-bit states quantized, as one process holds them --


def _state_bytes(value) -> int:
    """What a state tensor holds in memory: a quantized one its codes, scales (and qmap)."""
    if hasattr(value, "codes"):
        parts = [value.codes, value.scale, getattr(value, "qmap", None)]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _unwrap_lowbit(rank, world, name):
    """A 64 x 128 matrix (8192 values: quantized by one process) beside biases (not), two
    steps wrapped at 'p_g_os', then unwrapped: every state of the type one process holds, of
    its bytes; at world 2 every rank gets the same rows, so codes and scales are one process's
    bit for bit."""
    import copy

    import torchao.optim

    def make(m):
        return getattr(torchao.optim, name)(m.parameters(), lr=1e-2, eps=1e-6)

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    model = copy.deepcopy(ref)
    ref_opt = make(ref)
    model, opt, _ = zerokit.group_sharded_parallel(model, make(model), "p_g_os", segment_size=10)
    exact = world == 2
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        rows = 4 if exact else 2 * world
        x, y = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if not exact:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model, opt = zerokit.unwrap(model, opt)
    mine, want = dict(model.named_parameters()), dict(ref.named_parameters())
    quantized = 0
    for pname, p in want.items():
        a, b = opt.state[mine[pname]], ref_opt.state[p]
        assert a.keys() == b.keys(), pname
        for key in b:
            what = f"{name} world {world}: {pname}.{key}"
            assert type(a[key]) is type(b[key]), f"{what}: {type(a[key])} vs {type(b[key])}"
            assert _state_bytes(a[key]) == _state_bytes(b[key]), what
            if hasattr(b[key], "codes"):
                quantized += 1
                assert a[key].shape == b[key].shape and a[key].block_size == b[key].block_size
                assert getattr(a[key], "signed", None) == getattr(b[key], "signed", None), what
                if exact:
                    assert torch.equal(
                        a[key].codes.view(torch.uint8), b[key].codes.view(torch.uint8)
                    ), what
                    assert torch.equal(a[key].scale, b[key].scale), what
            elif exact:
                assert torch.equal(a[key], b[key]), what
    assert quantized == 4, quantized  # exp_avg and exp_avg_sq of the two matrices
    # the plain optimizer steps on as one process does (after unwrap every rank is one)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    for m, o in ((model, opt), (ref, ref_opt)):
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
    if exact:
        for pname, p in want.items():
            assert torch.equal(mine[pname], p), pname


@pytest.mark.parametrize(
    "name, world",
    [
        ("AdamW8bit", 2),
        ("AdamW8bit", 3),
        pytest.param("AdamW4bit", 2, marks=pytest.mark.slow),
        pytest.param("AdamWFp8", 2, marks=pytest.mark.slow),
    ],
)
def test_unwrap_gives_back_low_bit_states_quantized(name, world):
    pytest.importorskip("torchao")
    run_distributed(_unwrap_lowbit, world, name)
