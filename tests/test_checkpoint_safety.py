"""Checkpoints that must be refused (with the file or tensor named, nothing changed), a pickle
payload that must never run, saves killed with SIGKILL, and a save failing on one rank."""

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn

from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError
from zerokit.checkpoint.index import seal


def _model_and_opt(seed=0, out=3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, out), nn.Tanh(), nn.Linear(out, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {
            id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in opt.state.items()
        },
        [dict(g, params=None) for g in opt.param_groups],
    )


def _assert_same_snapshot(a, b):
    for x, y in zip(a[0].values(), b[0].values()):
        assert torch.equal(x, y), "the model changed"
    assert a[1].keys() == b[1].keys()
    for key in a[1]:
        for k in a[1][key]:
            assert torch.equal(torch.as_tensor(a[1][key][k]), torch.as_tensor(b[1][key][k]))
    assert a[2] == b[2], "the hyperparameters changed"


@pytest.fixture
def good(tmp_path):
    model, opt = _model_and_opt()
    path = tmp_path / "good"
    checkpoint.save(path, model, opt)
    return path


def _index(path):
    with open(path / "index.json") as f:
        return json.load(f)


def _write_index(path, index):
    """An edit that also fixes the index's checksum (as an attacker would): what is refused
    is then refused by validation, not by the checksum."""
    (path / "index.json").write_bytes(seal(index))


def _break(path, how):
    shard = path / "rank00000.safetensors"
    index = _index(path)
    entry = index["tensors"]["0.weight"]
    if how == "missing file":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif how == "checksum":
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "header mismatch":
        entry["dtype"] = "float16"
    elif how == "overlap":
        entry["parts"]["0"].append(dict(entry["parts"]["0"][0], start=2, numel=3))
    elif how == "gap":
        entry["parts"]["0"][0]["numel"] -= 1
        entry["parts"]["0"][0]["start"] += 1
    elif how == "version":
        index["format_version"] = 99
    elif how == "escaping tensor":
        index["tensors"]["../../etc/passwd"] = index["tensors"].pop("0.bias")
    elif how == "escaping file":
        index["files"]["../evil.safetensors"] = index["files"].pop("rank00000.safetensors")
    if how in ("header mismatch", "overlap", "gap", "version", "escaping tensor", "escaping file"):
        _write_index(path, index)


CASES = {
    "missing file": r"rank00000\.safetensors: missing",
    "truncated": r"rank00000\.safetensors: \d+ bytes, the index says \d+ \(truncated\?\)",
    "checksum": r"rank00000\.safetensors: sha256 does not match",
    "header mismatch": r"'0\.weight@0' is F32 \[12\], the index says float16",
    "overlap": r"0\.weight: pieces overlap at element 2",
    "gap": r"0\.weight: elements 0\.\.1 are in no piece",
    "version": r"format version 99; this zerokit reads versions 2 and 3",
    "escaping tensor": r"tensor name '\.\./\.\./etc/passwd' would escape",
    "escaping file": r"file name '\.\./evil\.safetensors' would escape",
}


@pytest.mark.parametrize("how", list(CASES))
def test_bad_checkpoint_is_refused_and_nothing_changes(good, how):
    _break(good, how)
    model, opt = _model_and_opt(seed=1)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=CASES[how]):
        checkpoint.load(good, model, opt)
    _assert_same_snapshot(before, _snapshot(model, opt))


def test_inspect_says_when_a_checkpoint_is_not_usable(good, capsys):
    from zerokit.tools.cli import main as cli

    assert cli(["ckpt", "inspect", str(good)]) == 0
    _break(good, "truncated")
    assert cli(["ckpt", "inspect", str(good)]) == 1
    assert "NOT usable" in capsys.readouterr().out


def test_model_and_checkpoint_tensors_are_listed_both_ways(good):
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2), nn.Linear(2, 2))
    del model[0].bias
    model[0].register_parameter("bias", None)
    before = _snapshot(model, torch.optim.SGD(model.parameters()))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['3\.bias', '3\.weight'\], not in the model \['0\.bias'\]"):  # fmt: skip
        checkpoint.load(good, model)
    _assert_same_snapshot(before, _snapshot(model, torch.optim.SGD(model.parameters())))
    checkpoint.load(good, model, strict=False)  # loads what both have
    saved, _ = _model_and_opt()
    assert torch.equal(model[2].weight, saved[2].weight)


def test_shape_mismatch_and_dtype_narrowing_are_refused(good):
    model, opt = _model_and_opt(out=5)
    with pytest.raises(
        CheckpointError, match=r"0\.weight: checkpoint shape \[3, 4\], model \[5, 4\]"
    ):
        checkpoint.load(good, model, opt)
    model, _ = _model_and_opt()
    model.half()
    before = _snapshot(model, torch.optim.SGD(model.parameters()))
    with pytest.raises(CheckpointError, match=r"holds torch\.float32, the model torch\.float16"):
        checkpoint.load(good, model)
    _assert_same_snapshot(before, _snapshot(model, torch.optim.SGD(model.parameters())))
    model, _ = _model_and_opt()
    checkpoint.load(good, model.double())  # widening is fine


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling would create the marker file


def test_a_pickle_payload_never_runs(good, tmp_path):
    marker = tmp_path / "executed"
    shard = good / "rank00000.safetensors"
    size = shard.stat().st_size
    payload = pickle.dumps(_Payload(str(marker)))
    shard.write_bytes(payload + b"." * (size - len(payload) - 1))  # one byte short
    model, opt = _model_and_opt(seed=1)
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors: \d+ bytes, the index says"):
        checkpoint.load(good, model, opt)
    index = _index(good)  # the attacker fixes the index too
    index["files"]["rank00000.safetensors"] = {
        "size": shard.stat().st_size,
        "sha256": __import__("hashlib").sha256(shard.read_bytes()).hexdigest(),
    }
    _write_index(good, index)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        checkpoint.load(good, model, opt)
    with pytest.raises(CheckpointError):
        checkpoint.consolidate(str(good), str(tmp_path / "out.safetensors"))
    assert not marker.exists(), "the pickle payload ran"


# -- killed and failed saves -----------------------------------------------------------------
_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from zerokit.checkpoint import saving as save_module

    path, phase = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(64, 64)
    torch.nn.init.constant_(model.weight, 2.0)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if phase == "writing a shard":
        save_module.write_safetensors = die
    else:  # right after the index is in place, or after the old checkpoint was moved aside
        real_replace = os.replace
        last = {"index written": "index.json", "between renames": ".zerokit-old"}[phase]

        def replace(src, dst):
            real_replace(src, dst)
            if str(dst).endswith(last):
                die()

        save_module.os.replace = replace
    save_module.save(path, model)
    """
)


@pytest.mark.parametrize(
    "phase",
    [
        pytest.param("writing a shard", marks=pytest.mark.slow),
        pytest.param("index written", marks=pytest.mark.slow),
        "between renames",
    ],
)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, phase):
    path = tmp_path / "ckpt"
    model = nn.Linear(64, 64)
    nn.init.constant_(model.weight, 1.0)
    checkpoint.save(path, model)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path), phase], env=env)
    assert done.returncode == -signal.SIGKILL
    loaded = nn.Linear(64, 64)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, model.weight), "the previous checkpoint was damaged"
    nn.init.constant_(model.weight, 3.0)
    checkpoint.save(path, model)  # a later save cleans up the debris
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, model.weight)


def _one_rank_fails(rank, world_size, path):
    import zerokit
    from zerokit.checkpoint import saving

    def sharded(value):  # every rank holds (and writes) half of it
        model = nn.Linear(8, 8)
        nn.init.constant_(model.weight, value)
        model, _, _ = zerokit.group_sharded_parallel(
            model, torch.optim.SGD(model.parameters()), "os"
        )
        return model

    checkpoint.save(path, sharded(1.0))
    if rank == 1:

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        saving.write_safetensors = disk_full
    with pytest.raises(CheckpointError, match=r"rank 1: writing its shard failed: .*No space left"):
        checkpoint.save(path, sharded(2.0))
    loaded = nn.Linear(8, 8)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.ones(8, 8))
    assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]


def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path):
    run_distributed(_one_rank_fails, 2, str(tmp_path / "ckpt"))


def test_a_long_list_of_differing_names_is_cut_short(good):
    """A model with many tensors the checkpoint lacks names the first ten and counts the rest,
    so a strict mismatch on a large model stays a message one can read."""
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(20)))
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(good, model)
    message = str(refused.value)
    ten_names_and_a_count = r"missing from the checkpoint \[('[\w.]+', ){9}'[\w.]+' and \d+ more\]"
    assert re.search(ten_names_and_a_count, message), message
