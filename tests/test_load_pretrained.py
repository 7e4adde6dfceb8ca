"""load_pretrained: plain safetensors weights (a file, a Hugging Face directory) into a model
built on meta and wrapped at any level; each rank reads only its own elements; every bad
input is the same CheckpointError on every rank, with nothing changed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import (
    SMALL,
    Awkward,
    assert_same_params,
    global_batches,
    loss_fn,
    make_optimizer,
    train_reference,
    train_sharded,
)
from safetensors.torch import save_file
from torch import nn

import zerokit
from zerokit.checkpoint import CheckpointError, load_pretrained
from zerokit.checkpoint.pretrained import _Sources
from zerokit.core.state import state_of


def _reference_values() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return Awkward().state_dict()


def _save(path: str, tensors: dict[str, torch.Tensor], dtype, files: int = 1) -> None:
    """``path`` a file, or (``files`` > 1) a directory in Hugging Face's sharded layout."""
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).clone() for k, v in tensors.items()}
    if files == 1:
        save_file(tensors, path)
        return
    os.makedirs(path)
    names, weight_map = sorted(tensors), {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::files]}
        save_file(part, os.path.join(path, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _empty_awkward() -> nn.Module:
    with zerokit.empty_init():
        return Awkward()


def _loads_as_one_process(rank: int, world_size: int, sources) -> None:
    for path, dtype in sources:
        for level in zerokit.LEVELS:
            # the reference: the file's values (rounded to its dtype) in a plain model
            ref = Awkward()
            want = {k: v.to(dtype).float() for k, v in _reference_values().items()}
            ref.load_state_dict(want)
            model = _empty_awkward()
            opt = make_optimizer("adamw", model)
            model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
            assert load_pretrained(model, path) == ([], [])
            got = model.state_dict()
            for name, value in want.items():
                assert torch.equal(got[name], value), f"{level} {path}: {name}"
            batches = global_batches(2, 6)
            train_reference(ref, make_optimizer("adamw", ref), batches)
            train_sharded(model, opt, batches, rank, world_size)
            assert_same_params(model, ref, 2e-5, f"{level} {path} after 2 steps")


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_load_pretrained_equals_one_process_at_every_level(tmp_path, world_size):
    values = _reference_values()
    # one bf16 file without the tied head (filled once, from emb.weight), and an fp16
    # directory of two files holding both tied names
    single = str(tmp_path / "weights.safetensors")
    _save(single, {k: v for k, v in values.items() if k != "head.weight"}, torch.bfloat16)
    sharded = str(tmp_path / "hf")
    _save(sharded, values, torch.float16, files=2)
    # fp32, both tied names: the tied pair staged and checked, the rest read into place
    plain = str(tmp_path / "fp32.safetensors")
    _save(plain, values, torch.float32)
    sources = [(single, torch.bfloat16), (sharded, torch.float16), (plain, torch.float32)]
    run_distributed(_loads_as_one_process, world_size, sources)


# -- each rank reads its own elements only -----------------------------------------------------
def _reads_its_own(rank: int, world_size: int, path: str, level: str, out) -> None:
    reads = []
    original = _Sources.read

    def recording(self, name, lo, hi, into):
        reads.append((name, lo, hi))
        return original(self, name, lo, hi, into)

    _Sources.read = recording
    with zerokit.empty_init():
        model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 5, bias=False), nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)
    load_pretrained(model, path)
    held = sum(piece.numel for b in state_of(model).buckets for piece in b.pieces)
    assert sum(hi - lo for _, lo, hi in reads) == held, "read more than this rank's pieces"
    everything = [None] * world_size
    dist.all_gather_object(everything, reads)
    if rank == 0:
        out.put(everything)


@pytest.mark.parametrize("level", [pytest.param("os", marks=pytest.mark.slow), "p_g_os"])
def test_each_rank_reads_only_its_pieces_and_together_every_element_once(tmp_path, level):
    import multiprocessing as mp

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 5, bias=False), nn.Linear(5, 3))
    path = str(tmp_path / "w.safetensors")
    _save(path, plain.state_dict(), torch.float32)
    out = mp.get_context("fork").SimpleQueue()
    run_distributed(_reads_its_own, 3, path, level, out)
    covered = {
        name: torch.zeros(t.numel(), dtype=torch.int32) for name, t in plain.state_dict().items()
    }
    for reads in out.get():
        for name, lo, hi in reads:
            covered[name][lo:hi] += 1
    for name, count in covered.items():
        assert torch.all(count == 1), f"{name}: elements read {count.tolist()} times over the ranks"


# -- strict, and bad files ---------------------------------------------------------------------
def _wrapped_awkward(level: str = "p_g_os"):
    torch.manual_seed(1)
    model = Awkward()
    opt = make_optimizer("sgd", model)
    model, _, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
    return model


def _expect_unchanged(model, path, match, **kw) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(model, path, **kw)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the model changed"


def _strict(rank: int, world_size: int, tmp: str) -> None:
    values = _reference_values()
    model = _wrapped_awkward()
    # missing one name (a tied weight counts as present under either of its names)
    _expect_unchanged(model, f"{tmp}/missing.safetensors", r"missing from the files: 1 \(odd\)")
    # a name the model lacks
    _expect_unchanged(
        model, f"{tmp}/extra.safetensors", r"in the files but not in the model: 1 \(surplus\)"
    )
    # a shape mismatch: refused even with strict=False
    _expect_unchanged(
        model, f"{tmp}/shape.safetensors", r"odd: \[4\] in the file, \[3\]", strict=False
    )
    # nothing in common: the first ten names and the count
    _expect_unchanged(
        model, f"{tmp}/other.safetensors", r"missing from the files: 14 \(.*, \.\.\.\)"
    )
    # strict=False loads what both have, returns what does not match
    missing, unexpected = load_pretrained(model, f"{tmp}/missing.safetensors", strict=False)
    assert (missing, unexpected) == (["odd"], [])
    assert torch.equal(model.state_dict()["tiny"], values["tiny"])
    assert load_pretrained(model, f"{tmp}/extra.safetensors", strict=False) == ([], ["surplus"])
    # files that are not what they claim, named
    _expect_unchanged(model, f"{tmp}/truncated.safetensors", "truncated.safetensors: not a valid")
    _expect_unchanged(model, f"{tmp}/garbage.safetensors", "garbage.safetensors: not a valid")
    _expect_unchanged(model, f"{tmp}/lost", r"model-00002-of-00002.safetensors: missing")
    _expect_unchanged(model, f"{tmp}/nowhere", "nowhere: no such file")


def test_strict_and_bad_files_raise_on_every_rank_changing_nothing(tmp_path):
    values = _reference_values()
    tmp = str(tmp_path)
    _save(
        f"{tmp}/missing.safetensors", {k: v for k, v in values.items() if k != "odd"}, torch.float32
    )
    _save(f"{tmp}/extra.safetensors", {**values, "surplus": torch.ones(2)}, torch.float32)
    _save(f"{tmp}/shape.safetensors", {**values, "odd": torch.ones(4)}, torch.float32)
    _save(f"{tmp}/other.safetensors", {"x": torch.ones(1)}, torch.float32)
    _save(f"{tmp}/full.safetensors", values, torch.float32)
    with open(f"{tmp}/full.safetensors", "rb") as f:
        data = f.read()
    with open(f"{tmp}/truncated.safetensors", "wb") as f:
        f.write(data[:-9])
    with open(f"{tmp}/garbage.safetensors", "wb") as f:
        f.write((20).to_bytes(8, "little") + b"{not json" + b" " * 40)
    _save(f"{tmp}/lost", values, torch.float32, files=2)
    os.remove(f"{tmp}/lost/model-00002-of-00002.safetensors")
    run_distributed(_strict, 2, tmp)


def _failing_reads(rank: int, world_size: int, tmp: str) -> None:
    """A read that fails on rank 1 (an I/O error): while staging (a bf16 file into fp32
    masters) nothing changes; into place (an fp32 file, after every rank checked its files)
    the model is partly loaded and every rank says so. Either way a load again succeeds."""
    from zerokit.checkpoint.reading import ShardFile

    values = _reference_values()
    model = _wrapped_awkward()
    original = ShardFile.pread_into

    def failing(self, key, lo, hi, out):
        raise OSError(5, "Input/output error")

    if rank == 1:
        ShardFile.pread_into = failing
    _expect_unchanged(model, f"{tmp}/bf16.safetensors", r"^rank 1: .*bf16.safetensors: cannot read")
    partly = r"^load_pretrained: rank 1: .*Input/output error; the model is partly loaded"
    with pytest.raises(CheckpointError, match=partly):
        load_pretrained(model, f"{tmp}/fp32.safetensors")
    ShardFile.pread_into = original
    assert load_pretrained(model, f"{tmp}/fp32.safetensors") == ([], [])
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in values.items())


def test_a_read_failing_on_one_rank_is_told_on_every_rank(tmp_path):
    values = _reference_values()
    _save(str(tmp_path / "bf16.safetensors"), values, torch.bfloat16)
    # the tied head left out: every tensor is read into place
    fp32 = {k: v for k, v in values.items() if k != "head.weight"}
    _save(str(tmp_path / "fp32.safetensors"), fp32, torch.float32)
    run_distributed(_failing_reads, 2, str(tmp_path))


class _Experts(nn.Module):  # Hugging Face's fused 3-D experts, the files' per-expert names
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 6, 4))
        self.down_proj = nn.Parameter(torch.zeros(2, 4, 3))


def _stage_of(rank: int) -> nn.Module:
    """As pipeline stages do, the ranks hold different tensors: only rank 1 the experts."""
    model = nn.Module()
    if rank == 0:
        model.a = nn.Linear(4, 4)
    else:
        model.layer = nn.Module()
        model.layer.experts = _Experts()
    return model


def _stages_load(rank: int, world_size: int, tmp: str) -> None:
    model = _stage_of(rank)
    assert load_pretrained(model, f"{tmp}/moe.safetensors") == ([], [])
    if rank == 1:  # each expert's gate and up rows, then its down
        up = torch.arange(2.0).repeat_interleave(6 * 4).view(2, 6, 4)
        assert torch.equal(model.layer.experts.gate_up_proj.detach(), up)
    fds = len(os.listdir("/proc/self/fd"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"bad.safetensors: ValueError"):
        load_pretrained(model, f"{tmp}/bad.safetensors")  # a per-expert name on a scalar
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert len(os.listdir("/proc/self/fd")) == fds, "a refused load left files open"


def test_ranks_holding_different_tensors_reach_one_verdict(tmp_path):
    """Per-expert files merged on the rank holding the experts are not "unexpected" on the
    rank that does not (it would refuse alone and leave the other waiting); a malformed file
    is refused on every rank with nothing changed and no file left open."""
    values = {"a.weight": torch.ones(4, 4), "a.bias": torch.ones(4)}
    for e in range(2):
        for proj, shape in (("gate", (3, 4)), ("up", (3, 4)), ("down", (4, 3))):
            values[f"layer.experts.{e}.{proj}_proj.weight"] = torch.full(shape, float(e))
    save_file(values, str(tmp_path / "moe.safetensors"))
    values["x.experts.0.down_proj.weight"] = torch.tensor(1.0)
    save_file(values, str(tmp_path / "bad.safetensors"))
    run_distributed(_stages_load, 2, str(tmp_path))


# -- Hugging Face models -----------------------------------------------------------------------
def _hf_models():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    small = {"vocab_size": 40, "bos_token_id": 0, "eos_token_id": 1}
    llama = {
        "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    }  # fmt: skip
    gpt2 = {"n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32}
    return [
        (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(**llama, tie_word_embeddings=tied, **small),
        )
        for tied in (True, False)
    ] + [(transformers.GPT2LMHeadModel, transformers.GPT2Config(**gpt2, **small))]


def _hf_round_trip(rank: int, world_size: int, dirs) -> None:
    x = torch.randint(0, 40, (6, 7), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    for (cls, config), path in zip(_hf_models(), dirs):
        ref = cls.from_pretrained(path)
        with zerokit.empty_init():
            model = cls(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
        assert load_pretrained(model, path) == ([], [])
        model.eval(), ref.eval()  # no dropout: one process and several give the same
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, ref(x).logits, atol=1e-6, rtol=0)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        loss_fn(ref(x).logits, y).backward()
        ref_opt.step()
        n = x.shape[0] // world_size
        local = slice(rank * n, (rank + 1) * n)
        loss_fn(model(x[local]).logits, y[local]).backward()
        opt.step()
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, ref(x).logits, atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_hugging_face_directory_round_trip(tmp_path, world_size):
    dirs = []
    for i, (cls, config) in enumerate(_hf_models()):
        torch.manual_seed(i)
        path = str(tmp_path / f"hf{i}")
        cls(config).save_pretrained(path, max_shard_size="20KB")  # several files and an index
        dirs.append(path)
    run_distributed(_hf_round_trip, world_size, dirs)


def _tied_llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cls, config = _hf_models()[0]
    assert config.tie_word_embeddings
    return cls, config


def _tied_files(rank: int, world_size: int, same: str, apart: str) -> None:
    """A tied model's files holding both tied names: equal, it loads as ``from_pretrained``
    does; 0.5 apart (``from_pretrained`` unties them), refused naming both, nothing loaded."""
    cls, config = _tied_llama()
    ref = cls.from_pretrained(same)
    with zerokit.empty_init():
        model = cls(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    assert load_pretrained(model, same) == ([], [])
    x = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    model.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x).logits, atol=1e-6, rtol=0)
    before = model.state_dict()
    names = r"'model.embed_tokens.weight' and 'lm_head.weight' are one tied parameter"
    with pytest.raises(CheckpointError, match=names + r".*0.5 apart.*nothing was loaded"):
        load_pretrained(model, apart)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused load changed it"


def test_tied_names_with_different_values_in_the_files(tmp_path):
    from safetensors.torch import load_file

    cls, config = _tied_llama()
    torch.manual_seed(0)
    same, apart = str(tmp_path / "same"), str(tmp_path / "apart")
    cls(config).save_pretrained(same)
    values = load_file(os.path.join(same, "model.safetensors"))
    assert "lm_head.weight" not in values  # HF saves a tied pair once
    values["lm_head.weight"] = values["model.embed_tokens.weight"].clone()
    save_file(values, os.path.join(same, "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(same, apart)  # config.json too
    values["lm_head.weight"] += 0.5
    save_file(values, os.path.join(apart, "model.safetensors"), metadata={"format": "pt"})
    # what zerokit refuses to guess: from_pretrained unties the pair and loads each name
    hf = cls.from_pretrained(apart)
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight
    assert torch.equal(hf.lm_head.weight, values["lm_head.weight"])
    assert torch.equal(hf.model.embed_tokens.weight, values["model.embed_tokens.weight"])
    run_distributed(_tied_files, 2, same, apart)


# -- tensor parallelism: each tp rank reads its slices (rows, or runs of columns) ----------------
def _tensor_parallel_load(rank: int, world_size: int, path: str) -> None:
    from test_meta_init import TPNet

    from zerokit import tensor_parallel as tp

    layout = zerokit.init_hybrid_parallel(2, 2)
    want = TPNet()
    want.load_state_dict({k: v.float() for k, v in _read_file(path).items()})
    for level in ("os", "p_g_os"):
        with zerokit.empty_init():
            model = TPNet(layout)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, group=layout.dp_group)
        assert load_pretrained(model, path) == ([], [])
        got = tp.gather_full_state_dict(model)
        for name, value in want.state_dict().items():
            assert torch.equal(got[name], value), f"{level} tp: {name}"


def _read_file(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.slow
def test_tensor_parallel_slices_load_from_the_full_tensors(tmp_path):
    from test_meta_init import TPNet

    torch.manual_seed(2)
    path = str(tmp_path / "tp.safetensors")
    _save(path, TPNet().state_dict(), torch.bfloat16)
    run_distributed(_tensor_parallel_load, 4, path)


# -- memory while loading ------------------------------------------------------------------------
def _load_growth(rank: int, world_size: int, path: str, out) -> None:
    import ctypes

    from test_meta_init import Tower, _status

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # freed big blocks go back to the OS
    with zerokit.empty_init():
        model = Tower()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    load_pretrained(model, path)
    growth = torch.tensor([_status("VmHWM") - before], dtype=torch.float64)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put(float(growth))


def test_loading_grows_a_rank_by_its_shards_plus_one_tensor(tmp_path):
    """While loading, a rank holds its staged shard pieces (36 MiB / 2) and the file's pages
    being copied (dropped after each read), plus a fixed cost (8 MiB); a rank that kept the
    mapped pages, or read whole tensors, would hold twice its shards or more."""
    import multiprocessing as mp

    from test_meta_init import BLOCKS, DIM, MIB, Tower

    torch.manual_seed(0)
    path = str(tmp_path / "tower.safetensors")
    save_file(Tower().state_dict(), path)
    out = mp.get_context("fork").SimpleQueue()
    run_distributed(_load_growth, 2, path, out)
    growth = out.get()
    shards, largest = (BLOCKS + 1) * DIM * DIM * 4 / 2, DIM * DIM * 4
    bound = shards + largest + 8 * MIB
    assert growth <= bound, f"grew {growth / MIB:.1f} MiB while loading > {bound / MIB:.1f} MiB"
