"""Loads return one checkpoint or an error: the index's own checksum, every field validated
before anything is allocated (a raw IndexError/KeyError never escapes), tied names and
hyperparameters checked, files read through the handle that was verified, symbolic links
and special files refused without being followed, ranks agreeing on the checkpoint."""

import json
import os
import time

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn

from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError
from zerokit.checkpoint.index import seal
from zerokit.checkpoint.reading import ShardFile
from zerokit.tools.cli import main as cli


class Tied(nn.Module):
    def __init__(self, value: float = 1.0):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3, bias=False)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        for p in self.parameters():
            nn.init.constant_(p, value)
        with torch.no_grad():
            self.mid.weight.add_(torch.arange(9.0).view(3, 3))

    def forward(self, idx):
        return self.head(self.mid(self.emb(idx)))


def _saved(tmp_path, value=1.0, name="ckpt"):
    model = Tied(value)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    path = tmp_path / name
    checkpoint.save(path, model, opt)
    return path


def _index(path):
    return json.loads((path / "index.json").read_text())


def _fresh():
    model = Tied(9.0)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_an_edited_index_is_refused_by_its_checksum(tmp_path):
    path = _saved(tmp_path)
    index = _index(path)
    index["optimizer"]["param_groups"][0]["hyperparameters"]["lr"] = 0.2
    (path / "index.json").write_text(json.dumps(index))  # not re-sealed
    model, opt = _fresh()
    with pytest.raises(CheckpointError, match="the index's checksum does not match its contents"):
        checkpoint.load(path, model, opt)
    assert opt.param_groups[0]["lr"] == 0.5


def _swap_keys(index):
    """Two pieces of the same size and dtype: only the key check tells them apart."""
    a = index["tensors"]["optim.exp_avg.mid.weight"]["parts"]["0"][0]
    b = index["tensors"]["optim.exp_avg_sq.mid.weight"]["parts"]["0"][0]
    a["key"], b["key"] = b["key"], a["key"]


EDITS = {  # re-sealed: the attacker recomputes the checksum; validation must still refuse
    "swapped piece keys": (
        lambda ix: _swap_keys(ix),
        r"optim\.exp_avg\.mid\.weight: the piece at 0 is keyed 'optim\.exp_avg_sq\.mid\.weight@0'",
    ),
    "redirected alias": (
        lambda ix: ix["aliases"].update({"head.weight": "mid.weight"}),
        r"the model ties head\.weight to emb\.weight, the checkpoint ties it to mid\.weight",
    ),
    "lr 'abc'": (
        lambda ix: ix["optimizer"]["param_groups"][0]["hyperparameters"].update(lr="abc"),
        r"param group 0: lr is 'abc' in the checkpoint; the optimizer holds 0\.5",
    ),
    "negative lr": (
        lambda ix: ix["optimizer"]["param_groups"][0]["hyperparameters"].update(lr=-1.0),
        r"param group 0: lr is -1\.0 in the checkpoint",
    ),
    "betas of three": (
        lambda ix: ix["optimizer"]["param_groups"][0]["hyperparameters"].update(
            betas=[0.9, 0.9, 0.9]
        ),
        r"param group 0: betas is \[0\.9, 0\.9, 0\.9\]",
    ),
    "amsgrad a number": (
        lambda ix: ix["optimizer"]["param_groups"][0]["hyperparameters"].update(amsgrad=3),
        r"param group 0: amsgrad is 3",
    ),
    "step NaN-like string": (
        lambda ix: next(iter(ix["optimizer"]["scalar_state"].values()))["step"].update(value="nan"),
        r"optimizer state 'step' of .* must be a finite number",
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_and_resealed_index_is_still_refused(tmp_path, edit):
    path = _saved(tmp_path)
    index = _index(path)
    change, message = EDITS[edit]
    change(index)
    (path / "index.json").write_bytes(seal(index))
    model, opt = _fresh()
    before = _params(model)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.param_groups[0]["lr"] == 0.5 and not opt.state


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e999"])
def test_a_non_finite_number_in_the_index_is_refused(tmp_path, number):
    path = _saved(tmp_path)
    text = (path / "index.json").read_text()
    (path / "index.json").write_text(text.replace('"lr": 0.1', f'"lr": {number}'))
    with pytest.raises(CheckpointError, match=f"{number} is not a finite number"):
        checkpoint.load(path, *_fresh())


MALFORMED = {  # each would raise IndexError/KeyError/TypeError without validation
    "no parts": lambda ix: ix["tensors"]["mid.weight"].pop("parts"),
    "shape not a list": lambda ix: ix["tensors"]["mid.weight"].update(shape="3x3"),
    "negative dimension": lambda ix: ix["tensors"]["mid.weight"].update(shape=[-3, -3]),
    "tp dim out of range": lambda ix: ix["tensors"]["mid.weight"].update(
        tp={"dim": 5, "block_sizes": [3], "stride": 1}
    ),
    "tp no blocks": lambda ix: ix["tensors"]["mid.weight"].update(
        tp={"dim": 0, "block_sizes": [], "stride": 1}
    ),
    "tp stride zero": lambda ix: ix["tensors"]["mid.weight"].update(
        tp={"dim": 0, "block_sizes": [3], "stride": 0}
    ),
    "piece start a string": lambda ix: ix["tensors"]["mid.weight"]["parts"]["0"][0].update(
        start="0"
    ),
    "files a list": lambda ix: ix.update(files=[]),
    "layout missing": lambda ix: ix.pop("layout"),
    "level not a name": lambda ix: ix["layout"].update(level="../x"),
    "layout holds a list": lambda ix: ix["layout"].update(replicas=[1, 2]),
    "param group params not a list": lambda ix: ix["optimizer"]["param_groups"][0].update(params=7),
    "state tensor points elsewhere": lambda ix: next(
        iter(ix["optimizer"]["state_tensors"].values())
    ).update(exp_avg="mid.weight"),
    "alias to nothing": lambda ix: ix["aliases"].update({"head.weight": "nothing"}),
    "extra not an object": lambda ix: ix.update(extra=[1]),
    "a 400 GB tensor": lambda ix: ix["tensors"]["mid.weight"].update(
        shape=[100000, 1000000],
        parts={"0": [dict(ix["tensors"]["mid.weight"]["parts"]["0"][0], numel=10**11)]},
    ),
}


@pytest.mark.parametrize("how", list(MALFORMED))
def test_a_malformed_index_is_a_checkpoint_error_everywhere(tmp_path, how, capsys):
    path = _saved(tmp_path)
    index = _index(path)
    MALFORMED[how](index)
    (path / "index.json").write_bytes(seal(index))
    with pytest.raises(CheckpointError):
        checkpoint.load(path, *_fresh())
    started = time.perf_counter()
    for command in (
        ["inspect", str(path)],
        ["consolidate", str(path), str(tmp_path / "m.safetensors")],
    ):
        assert cli(["ckpt", *command]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"zerokit ckpt {command[0]}: error: ") and "Traceback" not in err
    assert time.perf_counter() - started < 5, "validation should not allocate or read much"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_file_replaced_after_it_was_verified_is_not_read(tmp_path, monkeypatch):
    """A save that replaces the files between the checksum and the read (the race of hashing
    by path and opening again by path): the values come from the file that was verified."""
    path = _saved(tmp_path, value=1.0)
    other = _saved(tmp_path, value=2.0, name="other")
    real_verify = ShardFile.verify

    def verify_then_replace(self, size, sha256):
        real_verify(self, size, sha256)
        name = os.path.basename(self.where)
        os.replace(other / name, path / name)  # a same-sized file, other values

    monkeypatch.setattr(ShardFile, "verify", verify_then_replace)
    model, opt = _fresh()
    checkpoint.load(path, model, opt)
    want = Tied(1.0)
    want_opt = torch.optim.AdamW(want.parameters(), lr=0.1)
    want(torch.tensor([[1, 2]])).sum().backward()
    want_opt.step()
    for key, value in want.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), f"{key} came from another save"


@pytest.mark.parametrize("kind", ["symlink out", "symlink in", "fifo", "index symlink"])
def test_symlinks_and_special_files_are_refused_unfollowed(tmp_path, kind):
    path = _saved(tmp_path)
    shard = path / "rank00000.safetensors"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 12345)
    if kind == "symlink out":
        shard.unlink()
        shard.symlink_to(secret)
    elif kind == "symlink in":  # even to a copy of itself
        os.replace(shard, path / "copy.bin")
        shard.symlink_to("copy.bin")
    elif kind == "fifo":
        shard.unlink()
        os.mkfifo(shard)  # opening it for reading would block forever
    else:
        os.replace(path / "index.json", tmp_path / "index.json")
        (path / "index.json").symlink_to(tmp_path / "index.json")
    what = "a FIFO" if kind == "fifo" else "a symbolic link"
    model, opt = _fresh()
    with pytest.raises(
        CheckpointError, match=f"is {what}; a checkpoint holds regular files only"
    ) as e:
        checkpoint.load(path, model, opt)
    assert "12345" not in str(e.value) and str(secret) not in str(e.value)


def test_the_checkpoint_directory_itself_may_be_a_symlink(tmp_path):
    path = _saved(tmp_path, value=1.0)
    (tmp_path / "latest").symlink_to(path)
    model, opt = _fresh()
    checkpoint.load(tmp_path / "latest", model, opt)
    assert torch.equal(model.emb.weight, checkpoint_values(path)["emb.weight"])


def checkpoint_values(path):
    model, opt = _fresh()
    checkpoint.load(path, model, opt)
    return model.state_dict()


def _different_checkpoints(rank, world_size, root):
    path = os.path.join(root, "a" if rank == 0 else "b")
    model, opt = _fresh()
    before = _params(model)
    with pytest.raises(CheckpointError, match=r"the checkpoint read \(sha256 of its index\) differs \(rank 0: .*; rank 1: "):  # fmt: skip
        checkpoint.load(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow  # fast subset: ranks given different paths to save (test_checkpoint_places)
def test_ranks_loading_different_checkpoints_are_refused(tmp_path):
    _saved(tmp_path, 1.0, "a")
    _saved(tmp_path, 2.0, "b")
    run_distributed(_different_checkpoints, 2, str(tmp_path))


def test_param_names_in_a_param_group_save_and_load(tmp_path):
    model = Tied(1.0)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
    )
    checkpoint.save(tmp_path / "ckpt", model, opt)
    model2 = Tied(2.0)
    named2 = list(model2.named_parameters())
    opt2 = torch.optim.AdamW(
        [{"params": [p for _, p in named2], "param_names": [n for n, _ in named2]}]
    )
    checkpoint.load(tmp_path / "ckpt", model2, opt2)
    assert torch.equal(model2.mid.weight, model.mid.weight)
