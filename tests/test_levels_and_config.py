"""Choosing the level by name, stage number, environment or config file; counting parameters
at every level; the line printed at wrap time."""

import json
import logging

import pytest
import torch
from dist_helpers import run_distributed
from models import make_model, make_optimizer

import zerokit
from zerokit.core.state import state_of
from zerokit.memory import format_bytes


def _levels(rank, world_size, toml_path, json_path):
    import io
    import os
    import sys

    plain = make_model("gpt")
    expected = sum(p.numel() for p in plain.parameters())
    # silenced before the first wrap (docs/GUIDE.md, The call), with no handler of the user's:
    # the stderr handler zerokit adds then must not bring the level back to INFO
    logger = logging.getLogger("zerokit")
    assert not logger.handlers and logger.level == logging.NOTSET  # a fresh process
    logger.setLevel(logging.WARNING)
    stderr, sys.stderr = sys.stderr, io.StringIO()  # zerokit's handler writes to this one
    try:
        for given, level in ((1, "os"), ("2", "os_g"), (3, "p_g_os"), ("os_g", "os_g")):
            model = make_model("gpt")
            model, _, _ = zerokit.group_sharded_parallel(model, make_optimizer("sgd", model), given)
            assert state_of(model).level == level
            assert zerokit.num_params(model) == expected, level  # 0 at p_g_os by p.numel()
        printed = sys.stderr.getvalue()
    finally:
        sys.stderr = stderr
    assert "zerokit: level" not in printed, printed
    assert logger.level == logging.WARNING
    os.environ["ZEROKIT_LEVEL"] = "3"
    model = make_model("gpt")
    model, _, _ = zerokit.group_sharded_parallel(model, make_optimizer("sgd", model))
    assert state_of(model).level == "p_g_os"
    del os.environ["ZEROKIT_LEVEL"]
    with pytest.raises(ValueError, match="ZEROKIT_LEVEL is not set"):
        model = make_model("gpt")
        zerokit.group_sharded_parallel(model, make_optimizer("sgd", model))
    for path in (toml_path, json_path):
        config = zerokit.load_config(path)
        assert isinstance(config, zerokit.ShardingConfig)
        model = make_model("gpt")
        model, _, _ = zerokit.group_sharded_parallel(
            model, make_optimizer("sgd", model), config=config
        )
        state = state_of(model)
        assert state.level == "os_g" and all(b.data.dtype == torch.bfloat16 for b in state.buckets)

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    model = make_model("gpt")
    zerokit.group_sharded_parallel(model, make_optimizer("adamw", model), "p_g_os")
    if rank == 0:  # one line, from rank 0 only
        (line,) = records
        assert "level 'p_g_os' (stage 3) sharded over 2 rank(s)" in line and "unit(s)" in line
        # the parameters are empty at 'p_g_os' after the wrap: the count is still the model's
        assert f"bucket(s), {expected:,} trainable parameters;" in line, (line, expected)
    else:
        assert records == []
    # the bytes are what the rank holds: at 'os' fp32 every rank holds the whole parameters
    # (P, not the P/N of its master shard), and no gradients or optimizer state yet
    records.clear()
    model = make_model("gpt")
    model, _, _ = zerokit.group_sharded_parallel(model, make_optimizer("sgd", model), "os")
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
    held = sum(storage.nbytes() for storage in storages.values())
    assert held >= 4 * expected  # the whole model, padding included
    if rank == 0:
        (line,) = records
        assert f"this rank holds {format_bytes(held)} of parameters, 0 B of gradients" in line, (
            line,
            format_bytes(held),
        )
        assert "0 B of optimizer state so far" in line, line


def test_level_by_number_environment_and_config(tmp_path):
    toml_path = tmp_path / "zerokit.toml"
    toml_path.write_text('level = 2\nmixed_precision = "bf16"\nbuffer_max_size = 4096\n')
    json_path = tmp_path / "zerokit.json"
    json_path.write_text(json.dumps({"level": "os_g", "mixed_precision": "bf16"}))
    run_distributed(_levels, 2, str(toml_path), str(json_path))


def test_a_config_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"level": 2, "stage": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['stage'\]; valid keys: level"):
        zerokit.load_config(path)
    path.write_text(json.dumps({"mixed_precision": "int8"}))
    with pytest.raises(ValueError, match="'bf16' or 'fp16'"):
        zerokit.load_config(path)


def test_one_config_paddle_arguments_fill_it():
    """Paddle's keyword arguments and ``ShardingConfig`` are one mechanism: an argument fills
    the config, the same value given both ways is accepted, two values are refused."""
    from zerokit.config import merge_arguments

    config = merge_arguments(None, level="os_g", sync_comm=True, exclude_layer=None)
    assert (config.level, config.sync_comm, config.exclude_layer) == ("os_g", True, ())
    same = merge_arguments(zerokit.ShardingConfig(sync_comm=True), sync_comm=True)
    assert same.sync_comm
    with pytest.raises(ValueError, match="segment_size is given twice"):
        merge_arguments(zerokit.ShardingConfig(segment_size=10), segment_size=20)
