"""``zerokit ckpt``: a short summary by default and an aligned table with ``--tensors``; no
traceback when the reader of a pipe goes away; clear errors and no debris from consolidate;
a consolidated file loads strictly into the plain model, tied names included."""

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from zerokit import checkpoint
from zerokit.checkpoint import load_consolidated
from zerokit.tools.cli import main as cli

LONG = "a_rather_long_module_name_that_is_longer_than_forty_characters"


class Model(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(blocks))
        setattr(self, LONG, nn.Linear(4, 4))
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("count", torch.tensor(3))


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = Model(blocks=20)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    path = tmp_path / "ckpt"
    checkpoint.save(path, model, opt, extra={"step": 1})
    return path, model


def test_inspect_gives_a_summary_and_tensors_on_request(saved, capsys):
    path, _ = saved
    assert cli(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) <= 10, out
    assert "model: 44 tensors, " in out[2] and "tied: head.weight -> emb.weight" in out[2]
    assert out[3].startswith("optimizer: AdamW, 1 param group(s), state exp_avg, exp_avg_sq, step")
    assert "extra state: step" in out
    assert out[-1] == "(--tensors lists every tensor)"
    assert cli(["ckpt", "inspect", "--tensors", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[next(i for i, line in enumerate(out) if line.startswith("files:")) + 1 : -1]
    assert len(table) == 1 + 44 + 2 * 43  # header, model tensors, two states per parameter
    assert out[-1].startswith("complete and verified")
    for column in ("shape", "dtype", "tp split"):  # every row's cell starts under its header
        at = table[0].index(column)
        assert all(row[at - 2 : at] == "  " and row[at] != " " for row in table), column


def test_inspect_into_a_closed_pipe_ends_quietly(saved):
    path, _ = saved
    done = subprocess.run(
        f"{sys.executable} -m zerokit ckpt inspect --tensors {path} | head -1",
        shell=True, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.stdout.startswith("checkpoint ") and done.stderr == "", done.stderr


def test_consolidate_errors_are_clear_and_leave_nothing(saved, tmp_path, capsys):
    path, _ = saved
    out = tmp_path / "out"
    out.mkdir()
    cases = {
        str(
            out
        ): r"output .*/out is a directory: give a \.safetensors file name, or --max-shard-size",
        str(out) + "/": r"is a directory",
        str(tmp_path / "missing" / "m.safetensors"): r"the directory .*/missing does not exist",
        str(tmp_path / "notes.txt"): r"must end in \.safetensors",
    }
    for output, message in cases.items():
        assert cli(["ckpt", "consolidate", str(path), output]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert re.search(message, err), err
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"] and os.listdir(out) == []
    assert cli(["ckpt", "consolidate", str(path), str(tmp_path / "f.safetensors")]) == 0
    assert cli(["ckpt", "consolidate", str(path), str(tmp_path / "f.safetensors"),
                "--max-shard-size", "1KB"]) == 2  # fmt: skip
    assert "exists and is not a directory" in capsys.readouterr().err


def test_a_failing_consolidate_removes_what_it_wrote(saved, tmp_path, monkeypatch):
    path, _ = saved
    module = importlib.import_module("zerokit.checkpoint.consolidate")

    calls = []
    real = module.write_safetensors

    def fail_on_third(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "write_safetensors", fail_on_third)
    assert (
        cli(["ckpt", "consolidate", str(path), str(tmp_path / "hf"), "--max-shard-size", "500B"])
        == 2
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_consolidated_checkpoint_loads_strictly_with_tied_names(saved, tmp_path, sharded):
    path, model = saved
    out = tmp_path / ("hf" if sharded else "model.safetensors")
    args = ["--max-shard-size", "600B"] if sharded else []
    assert cli(["ckpt", "consolidate", str(path), str(out), *args]) == 0
    if not sharded:
        with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"head\.weight\""):
            Model(blocks=20).load_state_dict(load_file(out))  # why the loader exists
    plain = Model(blocks=20)
    load_consolidated(out, plain)  # strict
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    assert plain.head.weight is plain.emb.weight


def test_consolidate_lightning_file(tmp_path, capsys):
    """``--lightning``: Lightning's entries ("lightning/K" in the extra) as its keys, the model's
    state_dict (tied names included) and the optimizer's as torch gives them. No Lightning
    needed: the file is a plain dict."""
    torch.manual_seed(0)
    model = Model(blocks=2)
    opt = torch.optim.AdamW([{"params": model.blocks.parameters(), "lr": 0.5},
                             {"params": [model.emb.weight, *getattr(model, LONG).parameters()]}])  # fmt: skip
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    plain = tmp_path / "plain"
    checkpoint.save(plain, model, opt, extra={"step": 2})
    assert cli(["ckpt", "consolidate", str(plain), "--lightning", str(tmp_path / "x.ckpt")]) == 2
    assert "holds no Lightning state" in capsys.readouterr().err
    assert cli(["ckpt", "consolidate", str(plain)]) == 2
    assert "give an output file (or --lightning PATH)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["plain"]

    path, out = tmp_path / "ckpt", tmp_path / "one.ckpt"
    hparams = {"lr": 0.5, "sizes": [4, 7]}
    extra = {"lightning/epoch": 3, "lightning/hyper_parameters": hparams, "other": 1}
    checkpoint.save(path, model, opt, extra=extra)
    assert cli(["ckpt", "consolidate", str(path), "--lightning", str(out)]) == 0
    got = torch.load(out, weights_only=True)
    assert sorted(got) == ["epoch", "hyper_parameters", "optimizer_states", "state_dict"]
    assert got["epoch"] == 3 and got["hyper_parameters"] == hparams
    want = model.state_dict()
    assert got["state_dict"].keys() == want.keys()  # head.weight (tied) included
    assert all(torch.equal(got["state_dict"][k], v) for k, v in want.items())
    (state,), want = got["optimizer_states"], opt.state_dict()
    for g, w in zip(state["param_groups"], want["param_groups"], strict=True):
        assert g == {k: list(v) if isinstance(v, tuple) else v for k, v in w.items()}
    assert state["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert s.keys() == state["state"][i].keys()
        assert all(torch.equal(state["state"][i][k], v) for k, v in s.items()), i
    fresh = torch.optim.AdamW([{"params": model.blocks.parameters(), "lr": 0.5},
                               {"params": [model.emb.weight, *getattr(model, LONG).parameters()]}])  # fmt: skip
    fresh.load_state_dict(state)  # torch takes it as its own
    # saved without the optimizer (Lightning's weights_only): no optimizer_states, as Lightning's
    checkpoint.save(tmp_path / "weights", model, extra=extra)
    assert cli(["ckpt", "consolidate", str(tmp_path / "weights"), "--lightning", str(out)]) == 0
    assert "optimizer_states" not in torch.load(out, weights_only=True)
    inside = str(path / "one.ckpt")
    assert cli(["ckpt", "consolidate", str(path), "--lightning", inside]) == 2
    assert "inside the checkpoint" in capsys.readouterr().err


def test_a_sharded_hugging_face_set_has_its_config_and_loads_with_from_pretrained(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    checkpoint.save(tmp_path / "ckpt", model)
    out = tmp_path / "hf"
    assert (
        cli(["ckpt", "consolidate", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "8KB"])
        == 0
    )
    assert "config.json" in capsys.readouterr().out
    assert (out / "generation_config.json").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_set_without_a_config_says_so(saved, tmp_path, capsys):
    path, _ = saved
    out = tmp_path / "set"
    assert cli(["ckpt", "consolidate", str(path), str(out), "--max-shard-size", "300B"]) == 0
    assert "has no config.json" in capsys.readouterr().out


def test_a_corrupted_file_found_while_consolidating_leaves_no_output(saved, tmp_path):
    """The sha256s are checked beside the writing: a mismatch still leaves nothing."""
    path, _ = saved
    shard = path / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF  # a value's last byte: size and header still fine
    shard.write_bytes(bytes(raw))
    out = tmp_path / "model.safetensors"
    with pytest.raises(checkpoint.CheckpointError, match="sha256 does not match"):
        checkpoint.consolidate(str(path), str(out))
    assert not out.exists()
