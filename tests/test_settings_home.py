"""One home for every setting: each ``ShardingConfig`` field reaches every place that takes
settings, derived from ``dataclasses.fields`` (a new field is covered here at once), one level
parser, one default, and one name for each of the two group roles."""

import dataclasses
import inspect
import json

import pytest
import torch.distributed as dist
from dist_helpers import run_distributed
from models import make_model, make_optimizer
from torch import nn

import zerokit
from zerokit.config import (
    DEFAULT_LEVEL,
    ShardingConfig,
    agreement_fields,
    knob_names,
    load_config,
    parse_level,
)
from zerokit.parallelize import _one_config

FIELDS = [f.name for f in dataclasses.fields(ShardingConfig)]
_GIVEN = {"level": "os_g", "mixed_precision": "bf16"}  # values that are not the defaults


def _other_value(name: str):
    """A value of field ``name`` other than its default, as a user would give it."""
    if name in _GIVEN:
        return _GIVEN[name]
    default = getattr(ShardingConfig(), name)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, tuple):
        return (nn.Linear,)  # a module class: exclude_layer and wrap both take one
    raise AssertionError(f"a new field {name!r}: give this test a value for it in _GIVEN")


def _held(name: str):
    """The value as a config holds it."""
    return getattr(ShardingConfig(**{name: _other_value(name)}), name)


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_reaches_strategy_parallelize_and_agreement(name):
    value, held = _other_value(name), _held(name)
    strategy = zerokit.Strategy(**{name: value})
    assert getattr(strategy.sharding(), name) == held
    # parallelize(config=), and a strategy's knob: both reach the config it passes on
    assert getattr(_one_config(ShardingConfig(**{name: value}), None, None), name) == held
    assert getattr(_one_config(None, strategy, None), name) == held
    # the ranks compare it by its name: a rank given another value would be named with it
    model = nn.Sequential(nn.Linear(2, 2))
    plain = agreement_fields(ShardingConfig(), model)
    changed = agreement_fields(ShardingConfig(**{name: value}), model)
    assert set(FIELDS) <= set(plain) and plain[name] != changed[name]


@pytest.mark.parametrize("name", knob_names(in_files=True))
@pytest.mark.parametrize("ext", ["json", "yaml", "toml"])
def test_every_file_field_is_read_by_load_config(tmp_path, name, ext):
    value = _other_value(name)
    path = tmp_path / f"zerokit.{ext}"
    # JSON's spelling of a bool, an int or a string is also TOML's and YAML's
    text = {"json": json.dumps({name: value}), "yaml": f"{name}: {json.dumps(value)}",
            "toml": f"{name} = {json.dumps(value)}"}[ext]  # fmt: skip
    path.write_text(text + "\n")
    assert getattr(load_config(path), name) == _held(name)


def test_the_fields_no_file_can_spell_are_named():
    """``exclude_layer`` and ``wrap`` hold module classes: a file cannot give them."""
    assert set(FIELDS) - set(knob_names(in_files=True)) == {"exclude_layer", "wrap"}


@pytest.mark.parametrize("name", sorted(set(FIELDS) - {"level", "mixed_precision"}))
def test_every_field_reaches_the_lightning_and_fabric_strategies(name):
    pytest.importorskip("lightning")
    from zerokit.integrations.fabric import ZeroKitFabricStrategy
    from zerokit.integrations.lightning import ZeroKitStrategy

    for cls in (ZeroKitStrategy, ZeroKitFabricStrategy):
        assert getattr(cls(**{name: _other_value(name)}).config, name) == _held(name), cls
        config = ShardingConfig(**{name: _other_value(name)})
        assert getattr(cls(config=config).config, name) == _held(name), cls


def test_one_level_parser_names_and_stage_numbers():
    for given, name in [(1, "os"), (2, "os_g"), (3, "p_g_os"), ("1", "os"), (" 3 ", "p_g_os")]:
        assert parse_level(given) == name
    for name in zerokit.LEVELS:
        assert parse_level(name) == name
    for bad in ("stage3", "zero3", 0, 4, True):
        with pytest.raises(ValueError, match="unknown level"):
            parse_level(bad)
    # every entry point takes the stage numbers, held as the name
    assert ShardingConfig(level=2).level == "os_g" == zerokit.Strategy(level="2").level


def test_one_default_level():
    """The entry points with a default share ``DEFAULT_LEVEL``; ``group_sharded_parallel``
    keeps Paddle's signature, whose level is given (None reads ``$ZEROKIT_LEVEL``)."""
    assert zerokit.Strategy().level == DEFAULT_LEVEL
    assert inspect.signature(zerokit.parallelize).parameters["level"].default is None
    assert _one_config(None, None, None).level == DEFAULT_LEVEL  # parallelize's None
    assert inspect.signature(zerokit.group_sharded_parallel).parameters["level"].default is None
    pytest.importorskip("lightning")
    from zerokit.integrations.fabric import ZeroKitFabricStrategy
    from zerokit.integrations.lightning import ZeroKitStrategy

    # not given (None): config's level, else DEFAULT_LEVEL, decided at the wrap as above
    assert ZeroKitStrategy().level is None and ZeroKitFabricStrategy().level is None


def test_a_knob_given_twice_differently_is_refused_by_parallelize():
    with pytest.raises(ValueError, match="level is given twice"):
        _one_config(ShardingConfig(level="os"), None, "os_g")
    strategy = zerokit.Strategy(buffer_max_size=200)
    with pytest.raises(ValueError, match="buffer_max_size is given twice"):
        _one_config(ShardingConfig(buffer_max_size=100), strategy, None)
    assert _one_config(ShardingConfig(buffer_max_size=200), strategy, None).level == DEFAULT_LEVEL


def _group_names(rank, world_size):
    """Our names for the two roles and Paddle's are one call; both at once, differently, is
    refused before anything changes."""
    world = dist.group.WORLD
    model = make_model("awkward")
    model, _, _ = zerokit.group_sharded_parallel(
        model, make_optimizer("sgd", model), "os", shard_group=world, replica_group=world
    )
    assert zerokit.core.state.state_of(model).process_group is world
    model = make_model("awkward")
    config = ShardingConfig(level="os_g", sync_comm=True)
    model, _ = zerokit.parallelize(model, make_optimizer("sgd", model), config=config)
    state = zerokit.core.state.state_of(model)
    assert state.level == "os_g" and state.sync_comm
    other = dist.new_group([0])
    model = make_model("awkward")
    with pytest.raises(TypeError, match="shard_group is given twice"):
        zerokit.group_sharded_parallel(
            model, make_optimizer("sgd", model), "os", group=world, shard_group=other
        )
    with pytest.raises(TypeError, match="replica_group is given twice"):
        zerokit.group_sharded_parallel(
            model, make_optimizer("sgd", model), "os", dp_group=world, replica_group=other
        )


def test_the_group_roles_by_our_names_and_paddles():
    run_distributed(_group_names, 1)
