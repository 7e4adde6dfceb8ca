"""Bad input gets a clear error that says what to do, and nothing is changed."""

import re

import pytest
import torch
from dist_helpers import run_distributed
from models import make_model, make_optimizer
from torch import nn

import zerokit


def test_no_process_group_says_how_to_start_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    model = make_model("awkward")
    with pytest.raises(RuntimeError, match=r"torchrun.*init_process_group"):
        zerokit.group_sharded_parallel(model, make_optimizer("sgd", model), "os")


def _snapshot(model, opt):
    return (
        type(model),
        type(opt),
        {k: v.clone() for k, v in model.state_dict().items()},
        [list(g["params"]) for g in opt.param_groups],
    )


def _assert_untouched(model, opt, snapshot):
    cls_m, cls_o, state, groups = snapshot
    assert type(model) is cls_m and type(opt) is cls_o
    assert not hasattr(model, "_zerokit") and not hasattr(opt, "_zerokit")
    assert all(a is b for g, h in zip(groups, opt.param_groups) for a, b in zip(g, h["params"]))
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


class TwoDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2, device="meta")


def _bad_inputs(rank, world_size):
    cases = [
        ("unknown level", {"level": "stage2"}, ValueError, "valid levels: 'os'"),
        ("scaler", {"level": "os", "scaler": object()}, TypeError, "ShardedGradScaler"),
        (
            "mixed precision",
            {"level": "os", "mixed_precision": "int8"},
            ValueError,
            "'bf16' or 'fp16'",
        ),
        ("a knob of the wrong type", {"level": "os", "offload": "yes"}, TypeError, "offload"),
        (  # world size 2: the world as both shard group and replica group shares 2 ranks
            "dp_group overlapping group",
            {"level": "os", "dp_group": torch.distributed.group.WORLD},
            ValueError,
            "must share exactly this rank",
        ),
        (
            "a group without this rank",
            {"level": "os", "group": -100},
            ValueError,
            "not a process group of this rank",
        ),
        ("exclude_layer", {"level": "os_g", "exclude_layer": [nn.Linear]}, ValueError, "p_g_os"),
    ]
    for _what, kwargs, error, match in cases:
        model = make_model("awkward")
        opt = make_optimizer("adamw", model)
        snapshot = _snapshot(model, opt)
        with pytest.raises(error, match=match):
            zerokit.group_sharded_parallel(model, opt, **kwargs)
        _assert_untouched(model, opt, snapshot)

    model = make_model("awkward")
    stranger = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    snapshot = _snapshot(model, opt)
    with pytest.raises(ValueError, match="not parameters of the model"):
        zerokit.group_sharded_parallel(model, opt, "os")
    _assert_untouched(model, opt, snapshot)

    model = TwoDevices()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="more than one device"):
        zerokit.group_sharded_parallel(model, opt, "os")
    assert type(model) is TwoDevices

    model = make_model("awkward")
    model, opt, _ = zerokit.group_sharded_parallel(model, make_optimizer("sgd", model), "os")
    with pytest.raises(ValueError, match="already wrapped"):
        zerokit.group_sharded_parallel(model, opt, "os_g")
    with pytest.raises(TypeError, match="group_sharded_parallel"):
        zerokit.clip_grad_norm_(make_model("awkward"), 1.0)


def test_bad_input_is_refused_before_anything_changes():
    run_distributed(_bad_inputs, 2)


# -- arguments at the edges: what one entry point takes, every one takes ----------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"offload": "yes"}, TypeError, "offload must be True or False, got str 'yes'"),
        ({"sync_comm": 1}, TypeError, "sync_comm must be True or False"),
        ({"buffer_max_size": 1.5}, TypeError, "buffer_max_size must be a positive int"),
        ({"segment_size": 0}, TypeError, "segment_size must be a positive int"),
        ({"exclude_layer": nn.Linear}, TypeError, "exclude_layer must be a list or tuple"),
        ({"mixed_precision": torch.bfloat16}, TypeError, "a name 'bf16' or 'fp16'"),
        ({"init_fn": "normal"}, TypeError, "init_fn must be a callable"),
    ],
)
def test_a_knob_of_the_wrong_type_is_named_before_anything_changes(kwargs, error, match):
    """No process group is needed to be told: the types are checked first."""
    model = make_model("awkward")
    opt = make_optimizer("sgd", model)
    snapshot = _snapshot(model, opt)
    with pytest.raises(error, match=re.escape(match)):
        zerokit.group_sharded_parallel(model, opt, "os", **kwargs)
    _assert_untouched(model, opt, snapshot)
    key = next(iter(kwargs))
    if key in zerokit.ShardingConfig.__dataclass_fields__ and key != "mixed_precision":
        with pytest.raises(error, match=re.escape(match)):  # the config checks alike
            zerokit.ShardingConfig(**kwargs)


def test_the_optimizer_given_first_is_told_the_order():
    model = make_model("awkward")
    opt = make_optimizer("adamw", model)
    with pytest.raises(TypeError, match=r"the model first, then the optimizer: got \(AdamW, "):
        zerokit.group_sharded_parallel(opt, model, "os")


def _wrap_named_precision(rank, world_size):
    model = make_model("awkward")
    opt = make_optimizer("sgd", model)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, 3, mixed_precision="bf16")
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert dtypes == {torch.bfloat16}, dtypes  # the compute copy, as MixedPrecision(bf16)'s
    want = zerokit.MixedPrecision(param_dtype=torch.bfloat16)
    assert zerokit.ShardingConfig(mixed_precision="bf16").mixed_precision == want


def test_a_precision_name_is_taken_as_toml_and_strategy_take_it():
    run_distributed(_wrap_named_precision, 1)


def test_the_lightning_strategy_takes_the_precision_names_too():
    pytest.importorskip("lightning")
    from zerokit.integrations import _lightning_common as common

    assert common.check_options("ZeroKitStrategy", 3, "bf16", {}) == "p_g_os"
    policy = common.precision_policy("32-true", "bf16", "ZeroKitStrategy")
    assert policy == zerokit.MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'bf16' or 'fp16'"):
        common.check_options("ZeroKitStrategy", 3, "int8", {})


def test_the_cli_takes_stage_numbers_as_python_does(capsys):
    from zerokit.tools import cli

    args = ["plan", "--model", "verify_models:tiny_gpt", "--world", "2", "--seq", "8"]
    assert cli.main([*args, "--level", "3"]) == 0
    by_number = capsys.readouterr().out
    assert cli.main([*args, "--level", "p_g_os"]) == 0
    assert capsys.readouterr().out == by_number
    with pytest.raises(SystemExit):
        cli.main([*args, "--level", "4"])
    assert "use 'os', 'os_g', 'p_g_os' or the stage numbers 1, 2, 3" in capsys.readouterr().err


def test_an_unknown_preset_lists_the_presets(capsys):
    from zerokit.tools import cli

    code = cli.main(["plan", "--model", "zerokit.models.presets:gpt_7b", "--world", "2",
                     "--level", "os"])  # fmt: skip
    assert code == 2
    assert "no callable 'gpt_7b'; its factories: gpt_1_3b, gpt_6_7b" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["class", "classes"])
def test_an_optimizer_class_is_told_to_pass_an_instance(given):
    """``group_sharded_parallel(model, torch.optim.AdamW, "os")``: named before any process
    group is needed, nothing changed."""
    model = make_model("awkward")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW if given == "class" else [torch.optim.SGD, torch.optim.AdamW]
    first = "AdamW" if given == "class" else "SGD"
    with pytest.raises(TypeError) as refused:
        zerokit.group_sharded_parallel(model, optimizer, "os")
    message = str(refused.value)
    assert f"optimizer must be an optimizer instance, got the class {first}" in message
    assert f"group_sharded_parallel(model, {first}(model.parameters(), lr=1e-3), level)" in message
    assert not hasattr(model, "_zerokit")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _load_a_pretrained_folder(rank, world_size, folder):
    from zerokit.checkpoint import CheckpointError, load, load_pretrained

    model = make_model("awkward")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        load(folder, model)
    message = str(refused.value)
    assert "a save_pretrained folder" in message and "not a zerokit checkpoint" in message
    assert "zerokit.checkpoint.load_pretrained(model, path)" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert load_pretrained(model, folder) == ([], [])  # the call the message names loads it
    saved = make_model("awkward", seed=1).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_checkpoint_load_of_a_save_pretrained_folder_points_to_load_pretrained(tmp_path, layout):
    """A Hugging Face ``save_pretrained`` folder (config.json beside model.safetensors, or
    beside shards and model.safetensors.index.json), as save_pretrained writes it."""
    import json

    from safetensors.torch import save_file

    values, seen = {}, set()
    for name, value in make_model("awkward", seed=1).state_dict().items():
        if value.data_ptr() not in seen:  # a tied pair saved once, as save_pretrained does
            seen.add(value.data_ptr())
            values[name] = value.contiguous()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "awkward"}))
    if layout == "single":
        save_file(values, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(values)
        halves = {"model-00001-of-00002.safetensors": names[::2],
                  "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
        for file, keys in halves.items():
            save_file({k: values[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
        weight_map = {k: file for file, keys in halves.items() for k in keys}
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    run_distributed(_load_a_pretrained_folder, 2, str(tmp_path))
