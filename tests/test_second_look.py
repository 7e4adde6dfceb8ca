"""Issue 42, items 4-8: what a second look found silent (a setting that lost, unwrap's
low-bit states, Muon's owner balance, ``parallelize`` under torchrun, ``ckpt convert``'s
paths and note). Each test failed on the code before its fix."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.distributed as dist

import zerokit
from tests.dist_helpers import run_distributed, run_torchrun
from tests.models import make_model, make_optimizer
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

    level = None if sys.argv[1] == "default" else sys.argv[1]
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
@pytest.mark.parametrize("level", ["default", "os"])
def test_parallelize_under_torchrun_makes_its_process_group(tmp_path, level):
    """The same rule as ``group_sharded_parallel``: launched ranks without
    ``init_process_group`` train as the 2-rank world they are, equal to one process."""
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
