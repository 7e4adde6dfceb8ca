"""Issue 42, items 4-8: what a second look found silent (a setting that lost, unwrap's
low-bit states, Muon's owner balance, ``parallelize`` under torchrun, ``ckpt convert``'s
paths and note). Each test failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerokit
from tests.dist_helpers import run_distributed
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
