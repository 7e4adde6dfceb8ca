"""Every rank writes: ``consolidate --max-shard-size`` and ``convert --to hf`` split the set's
files across writers (forked processes with ``--writers N``, or the ranks of a group under
torchrun), each writing whole files of its own. The set must be the same, byte for byte, as
one writer's, every file written exactly once, and a failure on any writer the same
``CheckpointError`` on every writer, naming it and its file, with nothing left behind."""

from __future__ import annotations

import importlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed, run_torchrun

import zerokit
from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError, consolidate
from zerokit.checkpoint.convert import convert
from zerokit.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
CONSOLIDATE = importlib.import_module("zerokit.checkpoint.consolidate")
SHARD = 6000  # bytes: several files from either model


def _hf_model():
    """A tiny GPT-2 (its head tied to the token embedding)."""
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _save(rank, world_size, root):
    model = _hf_model()
    opt = torch.optim.AdamW(model.parameters())
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    checkpoint.save(os.path.join(root, "hf-gpt2"), model, opt)
    layout = zerokit.init_hybrid_parallel(1, 2)  # tp 2: qkv, mlp and embedding split
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    gpt = GPT(GPTConfig(**{**cfg.__dict__, "tensor_parallel": True}), layout)
    zerokit.save_group_sharded_model(gpt, os.path.join(root, "tp-gpt"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("writers"))
    run_distributed(_save, 2, root)
    return root


def _logging_writes(monkeypatch, log: str):
    """Each file written is logged with the writer's pid (forked writers inherit this)."""
    real = CONSOLIDATE.write_safetensors

    def logged(path, *args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {os.path.basename(path).split('.tmp-')[0]}\n")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(CONSOLIDATE, "write_safetensors", logged)


def _who_wrote(log: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in open(log).read().split("\n")[:-1]:
        pid, name = line.split()
        out.setdefault(name, []).append(pid)
    return out


def _same_bytes(one: list[str], many: list[str]) -> None:
    assert [os.path.basename(p) for p in one] == [os.path.basename(p) for p in many]
    for a, b in zip(one, many):
        with open(a, "rb") as fa, open(b, "rb") as fb:
            assert fa.read() == fb.read(), os.path.basename(a)


@pytest.mark.parametrize("source", ["hf-gpt2", "tp-gpt"])
@pytest.mark.parametrize("writers", [2, 3])
def test_writer_processes_write_the_same_bytes_as_one_writer(
    saved, tmp_path, monkeypatch, source, writers
):
    one = consolidate(os.path.join(saved, source), str(tmp_path / "one"), SHARD)
    log = str(tmp_path / "log")
    _logging_writes(monkeypatch, log)
    many = consolidate(os.path.join(saved, source), str(tmp_path / "many"), SHARD, writers=writers)
    _same_bytes(one, many)
    files = [os.path.basename(p) for p in many if p.endswith(".safetensors")]
    who = _who_wrote(log)
    assert sorted(who) == sorted(files) and all(len(p) == 1 for p in who.values())
    assert len(files) >= writers and len({p[0] for p in who.values()}) == writers
    assert sorted(os.listdir(tmp_path)) == ["log", "many", "one"]  # no temp directory left


def _consolidate_in_group(rank, world_size, root, out, log):
    CONSOLIDATE.write_safetensors = _logged_in(log, CONSOLIDATE.write_safetensors)
    consolidate(os.path.join(root, "hf-gpt2"), out, SHARD, group=dist.group.WORLD)


def _logged_in(log, real):
    def logged(path, *args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{dist.get_rank()} {os.path.basename(path).split('.tmp-')[0]}\n")
        return real(path, *args, **kwargs)

    return logged


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_write_the_same_bytes_and_from_pretrained_gives_the_model(
    saved, tmp_path, world_size
):
    one = consolidate(os.path.join(saved, "hf-gpt2"), str(tmp_path / "one"), SHARD)
    out, log = str(tmp_path / "many"), str(tmp_path / "log")
    run_distributed(_consolidate_in_group, world_size, saved, out, log)
    many = sorted(os.path.join(out, n) for n in os.listdir(out))
    _same_bytes(sorted(one), many)
    who = _who_wrote(log)
    assert all(len(r) == 1 for r in who.values()) and len(who) == len(one) - 3  # index, configs
    assert {r[0] for r in who.values()} == {str(r) for r in range(world_size)}
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    for key, value in _hf_model().state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("writers", [2, 3])
def test_convert_to_a_hugging_face_set_by_writers(saved, tmp_path, writers):
    source = os.path.join(saved, "hf-gpt2")
    one = convert(source, str(tmp_path / "one"), "hf", max_shard_size=SHARD)
    many = convert(source, str(tmp_path / "many"), "hf", max_shard_size=SHARD, writers=writers)
    assert sum(p.endswith(".safetensors") for p in one) >= writers
    _same_bytes(one, many)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "many"))
    for key, value in _hf_model().state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def _fail_on_rank(rank, world_size, root, out, failing, results):
    real = CONSOLIDATE.write_safetensors

    def failing_write(path, *args, **kwargs):
        if rank == failing:
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    CONSOLIDATE.write_safetensors = failing_write
    with pytest.raises(CheckpointError) as raised:
        consolidate(os.path.join(root, "hf-gpt2"), out, SHARD, group=dist.group.WORLD)
    with open(os.path.join(results, f"rank{rank}"), "w") as f:
        f.write(str(raised.value))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failing_rank_is_named_on_every_rank_and_nothing_is_left(saved, tmp_path, world_size):
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    (out / "keep.txt").write_text("a file of the user's")  # an existing directory is kept as is
    results.mkdir()
    failing = world_size - 1
    run_distributed(_fail_on_rank, world_size, saved, str(out), failing, str(results))
    messages = {(results / f"rank{r}").read_text() for r in range(world_size)}
    assert len(messages) == 1, messages  # the same error on every rank
    message = messages.pop()
    assert f"writer {failing} failed writing model-0000" in message
    assert "No space left on device" in message and "nothing was published" in message
    assert os.listdir(out) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out", "results"]


@pytest.mark.parametrize("how", ["raises", "dies"])
def test_a_failing_writer_process_is_named_and_nothing_is_left(saved, tmp_path, monkeypatch, how):
    real, parent = CONSOLIDATE.write_safetensors, os.getpid()

    def failing_write(path, *args, **kwargs):
        if os.getpid() != parent:  # writers 1 and 2, forked
            if how == "dies":
                os._exit(3)
            raise PermissionError(13, "Permission denied", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(CONSOLIDATE, "write_safetensors", failing_write)
    with pytest.raises(CheckpointError) as raised:
        consolidate(os.path.join(saved, "hf-gpt2"), str(tmp_path / "out"), SHARD, writers=3)
    message = str(raised.value)
    assert "writer 1 failed writing model-0000" in message, message
    assert ("the writer died" if how == "dies" else "Permission denied") in message
    assert "(and 1 other writer(s))" in message
    assert os.listdir(tmp_path) == []


def test_several_writers_need_a_set(saved, tmp_path):
    with pytest.raises(CheckpointError, match="give --max-shard-size"):
        consolidate(os.path.join(saved, "hf-gpt2"), str(tmp_path / "m.safetensors"), writers=2)
    with pytest.raises(CheckpointError, match="with --to hf"):
        convert(os.path.join(saved, "hf-gpt2"), str(tmp_path / "z"), "zerokit", writers=2)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_torchrun_ranks_consolidate_a_set(saved, tmp_path):
    out = tmp_path / "set"
    done = run_torchrun("-m", 2, "zerokit", "ckpt", "consolidate", os.path.join(saved, "hf-gpt2"),
                        str(out), "--max-shard-size", str(SHARD), cwd=str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("wrote ") == len(os.listdir(out))  # rank 0 reports, once
    one = consolidate(os.path.join(saved, "hf-gpt2"), str(tmp_path / "one"), SHARD)
    _same_bytes(sorted(one), sorted(str(out / n) for n in os.listdir(out)))


def test_a_write_failing_while_the_sha256s_are_hashed_is_the_error_raised(
    saved, tmp_path, monkeypatch
):
    """The checkpoint's files are hashed in threads beside the writing; a write that fails
    first closes the reader while a hash still reads its mapping. The write's error is what
    the caller gets (closing waits for the hash), not a BufferError from the mapping."""
    reading = importlib.import_module("zerokit.checkpoint.reading")
    real_hash, hashing = reading.ShardFile.check_sha256, []

    def slow_hash(shard, sha256):
        hashing.append(shard.where)
        view = memoryview(shard.mm)  # held while hashing, as hashlib's update holds it
        time.sleep(0.5)
        del view
        return real_hash(shard, sha256)

    def full_disk(path, *args, **kwargs):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(reading.ShardFile, "check_sha256", slow_hash)
    monkeypatch.setattr(CONSOLIDATE, "write_safetensors", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        consolidate(os.path.join(saved, "hf-gpt2"), str(tmp_path / "out"), SHARD)
    assert hashing and os.listdir(tmp_path) == []
