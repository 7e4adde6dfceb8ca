"""torch.distributed.checkpoint (DCP) directories in and out: an FSDP2 run moves to zerokit and
back and trains on as one uninterrupted process would (2e-5, fp32, AdamW with two param
groups); a DCP directory that does not fit the model is refused on every rank, nothing
changed."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_helpers import run_distributed
from models import (
    SMALL,
    assert_same_params,
    global_batches,
    make_model,
    make_optimizer,
    train_reference,
    train_sharded,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import zerokit
from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError, dcp_load
from zerokit.core.state import state_of

ATOL = 2e-5
BEFORE, AFTER = 3, 3
BATCHES = global_batches(BEFORE + AFTER, batch=12)  # 12: divisible by 2 and 3 ranks


def _reference():
    model = make_model("gpt")
    opt = make_optimizer("adamw", model)
    train_reference(model, opt, BATCHES)
    return model


def _fsdp2(seed: int = 0):
    model = make_model("gpt", seed=seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, make_optimizer("adamw", model)


def _fsdp2_saves(rank, world_size, path):
    model, opt = _fsdp2()
    train_sharded(model, opt, BATCHES[:BEFORE], rank, world_size)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd, "step": BEFORE}, checkpoint_id=path)


def _zerokit_loads(rank, world_size, path):
    model = make_model("gpt", seed=100 + rank)  # everything must come from the load
    opt = make_optimizer("adamw", model)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", **SMALL["p_g_os"])
    extra, asked, read = {"step": None}, [], dcp_load._Reads.read

    def recording(reads, directory):
        asked.extend(reads.items)
        return read(reads, directory)

    dcp_load._Reads.read = recording
    checkpoint.load(path, model, opt, extra=extra)
    assert extra["step"] == BEFORE
    held = sum(piece.numel for bucket in state_of(model).buckets for piece in bucket.pieces)
    model_reads = [i for i in asked if i.storage_index.fqn.startswith("model.")]
    assert sum(math.prod(i.lengths) for i in model_reads) == held, "read more than it holds"
    train_sharded(model, opt, BATCHES[BEFORE:], rank, world_size)
    assert_same_params(model, _reference(), ATOL, "FSDP2 at 2 -> zerokit p_g_os at 3")


@pytest.fixture(scope="module")
def fsdp2_dcp(tmp_path_factory):
    """FSDP2 at 2 ranks after 3 steps, saved as torchtitan and FSDP2 users save."""
    path = str(tmp_path_factory.mktemp("fsdp2") / "dcp")
    run_distributed(_fsdp2_saves, 2, path)
    return path


def test_fsdp2_dcp_checkpoint_resumes_in_zerokit_at_another_world_size(fsdp2_dcp):
    run_distributed(_zerokit_loads, 3, fsdp2_dcp)


def _bad_dcp(path: str) -> None:
    """The GPT's state with ``ln_f.bias`` left out and ``wpe.weight`` of another shape."""
    state = make_model("gpt").state_dict()
    del state["ln_f.bias"]
    state["wpe.weight"] = torch.zeros(3, 8)
    dcp.save({"model": state}, checkpoint_id=path, no_dist=True)


def _refused_everywhere(rank, world_size, path):
    model = make_model("gpt", seed=5)
    opt = torch.optim.AdamW(model.parameters())
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os_g")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(path, model)
    message = str(refused.value)
    assert "ln_f.bias" in message and "wpe.weight ([3, 8] in the checkpoint, [8, 8]" in message
    assert not message.startswith("rank "), "every rank found the same: said once"
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed"
    dist.barrier()


def test_a_dcp_checkpoint_that_does_not_fit_is_refused_on_every_rank(tmp_path):
    path = str(tmp_path / "bad")
    _bad_dcp(path)
    run_distributed(_refused_everywhere, 2, path)


def test_wrapper_names_are_normalised_and_top_level_model_keys_load(tmp_path):
    """torchtitan saves the model's keys at the top level; a compiled or checkpoint-wrapped
    model's state dict has ``_orig_mod.`` / ``_checkpoint_wrapped_module.`` in its names."""
    source = make_model("gpt", seed=1)
    state = {
        ("_orig_mod." + k if k.startswith("blocks") else k): v
        for k, v in source.state_dict().items()
    }
    state = {
        k.replace("blocks.0.", "blocks.0._checkpoint_wrapped_module."): v for k, v in state.items()
    }
    path = str(tmp_path / "titan")
    dcp.save({**state, "train_state": {"step": 7}}, checkpoint_id=path, no_dist=True)
    model = make_model("gpt", seed=2)
    extra = {"train_state": None}
    checkpoint.load(path, model, extra=extra)
    assert extra["train_state"] == {"step": 7}
    assert_same_params(model, source, 0, "top-level keys")


def _zerokit_saves_dcp(rank, world_size, path):
    model = make_model("gpt")
    opt = make_optimizer("adamw", model)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os_g", **SMALL["os_g"])
    train_sharded(model, opt, BATCHES[:BEFORE], rank, world_size)
    checkpoint.save(path, model, opt, extra={"step": BEFORE}, format="dcp")


def _fsdp2_loads(rank, world_size, path):
    model, opt = _fsdp2(seed=100 + rank)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd, "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert state["step"] == BEFORE
    train_sharded(model, opt, BATCHES[BEFORE:], rank, world_size)
    full, _ = get_state_dict(
        model,
        opt,
        options=torch.distributed.checkpoint.state_dict.StateDictOptions(
            full_state_dict=True, cpu_offload=True
        ),
    )
    want = _reference().state_dict()
    if rank == 0:
        for key, value in want.items():
            torch.testing.assert_close(full[key], value, atol=ATOL, rtol=0, msg=key)


def test_zerokit_saves_dcp_that_fsdp2_resumes_at_another_world_size(tmp_path):
    path = str(tmp_path / "dcp")
    run_distributed(_zerokit_saves_dcp, 2, path)
    assert sorted(os.listdir(tmp_path)) == ["dcp"]  # built aside, renamed into place
    run_distributed(_fsdp2_loads, 3, path)


def _resumes_in_one_process(path: str, what: str) -> None:
    model = make_model("gpt", seed=3)
    opt = make_optimizer("adamw", model)
    extra = {"step": None}
    checkpoint.load(path, model, opt, extra=extra)
    assert extra["step"] == BEFORE, what
    train_reference(model, opt, BATCHES[BEFORE:])
    assert_same_params(model, _reference(), ATOL, what)


def test_convert_between_dcp_zerokit_and_hf(fsdp2_dcp, tmp_path):
    from safetensors.torch import load_model

    from zerokit.tools.cli import main as cli

    as_zerokit, as_dcp = str(tmp_path / "zk"), str(tmp_path / "dcp")
    assert cli(["ckpt", "convert", fsdp2_dcp, as_zerokit, "--to", "zerokit"]) == 0
    assert os.path.isfile(os.path.join(as_zerokit, "index.json"))
    _resumes_in_one_process(as_zerokit, "DCP -> zerokit")
    assert cli(["ckpt", "convert", as_zerokit, as_dcp, "--to", "dcp"]) == 0
    _resumes_in_one_process(as_dcp, "DCP -> zerokit -> DCP")
    assert cli(["ckpt", "convert", as_dcp, str(tmp_path / "hf"), "--to", "hf"]) == 0
    plain, at_save = make_model("gpt", seed=4), make_model("gpt")
    train_reference(at_save, make_optimizer("adamw", at_save), BATCHES[:BEFORE])
    load_model(plain, str(tmp_path / "hf" / "model.safetensors"), strict=False)
    assert_same_params(plain, at_save, ATOL, "DCP -> hf")


def _tp_loads(rank, world_size, path):
    from models import VOCAB

    from zerokit import tensor_parallel as tp
    from zerokit.models.gpt import GPT, GPTConfig

    layout = zerokit.init_hybrid_parallel(1, 2)
    torch.manual_seed(7)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=8,
                    tensor_parallel=True)  # fmt: skip
    model = GPT(cfg, layout)
    opt = make_optimizer("adamw", model)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", group=layout.dp_group)
    checkpoint.load(path, model, opt)
    loss_fn = tp.ParallelCrossEntropy(layout=layout)
    for x, y in BATCHES[BEFORE:]:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    full = tp.gather_full_state_dict(model)
    for key, value in _reference().state_dict().items():
        torch.testing.assert_close(full[key], value, atol=ATOL, rtol=0, msg=key)


def test_fsdp2_dcp_checkpoint_resumes_tensor_parallel(fsdp2_dcp):
    run_distributed(_tp_loads, 2, fsdp2_dcp)


def test_inspect_summarises_a_dcp_directory_and_finds_a_truncated_file(fsdp2_dcp, tmp_path, capsys):
    import shutil

    from zerokit.tools.cli import main as cli

    assert cli(["ckpt", "inspect", fsdp2_dcp]) == 0
    out = capsys.readouterr().out
    assert "DCP checkpoint" in out and "state exp_avg, exp_avg_sq, step" in out
    assert "complete" in out
    damaged = str(tmp_path / "damaged")
    shutil.copytree(fsdp2_dcp, damaged)
    with open(os.path.join(damaged, "__1_0.distcp"), "r+b") as f:
        f.truncate(100)
    assert cli(["ckpt", "inspect", damaged]) == 1
    assert "__1_0.distcp: missing or shorter" in capsys.readouterr().out
