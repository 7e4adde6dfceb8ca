"""Split experts in checkpoints. ``zerokit.checkpoint`` (``save``, ``async_save``, ``load``,
``format="dcp"``, ``load_pretrained``, ``consolidate``) names a rank's experts as its part of
the unsplit model's [E, ...] tensors (``moe.state_dict.expert_splits``), optimizer state
included, so a run saved at one ep, level and world resumes at another: 2 AdamW steps, saved,
loaded elsewhere, 2 more steps equal one process's 4 steps on the same global batch (2e-5).
``full_state_dict`` / ``load_full_state_dict`` (the whole model on every rank, no optimizer
state) are checked with SGD, which has no state to carry."""

import functools
import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_helpers import run_distributed
from moe_models import batches, low_bit_expert_pieces, tiny_moe, train_ranks, train_reference
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import zerokit
import zerokit.checkpoint
from zerokit.checkpoint.holdings import collect
from zerokit.checkpoint.reading import ShardFile
from zerokit.moe import (
    apply_expert_parallel,
    full_state_dict,
    init_expert_groups,
    load_full_state_dict,
)

ATOL = 2e-5
EXPERTS = 4
TOKENS = batches(4, 12)  # 12 rows a step: each of 2, 3 or 4 ranks takes an equal slice
EXPERT_KEYS = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")]  # fmt: skip


@functools.cache
def _want(steps: int) -> dict[str, torch.Tensor]:
    """One process, the whole model, ``steps`` AdamW steps on the global batches."""
    model = tiny_moe("mixtral", EXPERTS)
    train_reference(model, TOKENS[:steps])
    return model.state_dict()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # train_reference's


def _model(ep: int, level: str | None, seed: int = 0):
    """The tiny Mixtral, its experts split over ep ranks (ep 1: the plain model), wrapped at
    ``level`` (None: bare), with AdamW. ``seed`` other than 0: weights a load must replace."""
    model = tiny_moe("mixtral", EXPERTS, seed=seed)
    if ep > 1:
        apply_expert_parallel(model, init_expert_groups(ep))
    opt = _adamw(model)
    if level is not None:
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
    return model, opt


def _whole(model, ep: int) -> dict[str, torch.Tensor]:
    return full_state_dict(model) if ep > 1 else model.state_dict()


def _same(got, want, what, atol=ATOL):
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{what}: {k}: {m}"
        )


class _recording(list):
    """(name, lo, hi) of every call of ``cls.method`` in this process, until put back."""

    def __init__(self, cls, method: str):
        super().__init__()
        self.cls, self.original = cls, getattr(cls, method)

        def recording(shard, name, lo, hi, *rest):
            self.append((name, lo, hi))
            return self.original(shard, name, lo, hi, *rest)

        setattr(cls, method, recording)


def _expert_name(name: str) -> bool:
    """An expert parameter or its optimizer state (``optim.<key>.<parameter>``)."""
    return any(name == k or name.endswith("." + k) for k in EXPERT_KEYS)


def _expert_elements_held(model, opt) -> int:
    """The expert elements (parameters and optimizer state) this rank holds and loads."""
    return sum(c.tensor.numel() for c in collect(model, opt).chunks if _expert_name(c.name))


def _leg(rank, world, ep, level, done, steps, load_from=None, save_to=None, how="save"):
    """Load (optimizer state too) what ``done`` steps left, train ``steps`` more, save; the
    model then equals one process after ``done + steps`` steps."""
    what = f"world {world} ep {ep} {level}, after step {done + steps}"
    model, opt = _model(ep, level, seed=7 if load_from else 0)
    if load_from is not None:
        reads = _recording(ShardFile, "read")
        zerokit.checkpoint.load(load_from, model, opt)
        ShardFile.read = reads.original
        held = _expert_elements_held(model, opt)  # the optimizer's state exists once loaded
        if os.path.exists(os.path.join(load_from, "index.json")):  # zerokit's format
            got = sum(hi - lo for key, lo, hi in reads if _expert_name(key.rpartition("@")[0]))
            assert got == held, f"{what}: read {got} expert elements, holds {held}"
    train_ranks(model, opt, TOKENS[done : done + steps], rank, world)
    if how == "async":
        zerokit.checkpoint.async_save(save_to, model, opt).result()
    elif how == "dcp":
        zerokit.checkpoint.save(save_to, model, opt, format="dcp")
    elif save_to is not None:
        zerokit.checkpoint.save(save_to, model, opt)
    _same(_whole(model, ep), _want(done + steps), what)


def test_resume_ep2_to_ep1_to_ep4_across_levels_and_worlds(tmp_path):
    """world 4 ep 2 'p_g_os' -> world 3 ep 1 'os_g' -> world 4 ep 4 'os'; and the first save
    at world 2 ep 2 'os', saved again by async_save and loaded in one process."""
    a, b, c = (str(tmp_path / x) for x in "abc")
    _want(4)  # computed once, before the ranks fork
    run_distributed(_leg, 4, 2, "p_g_os", 0, 2, None, a)
    with open(os.path.join(a, "index.json")) as f:
        index = json.load(f)
    assert index["layout"]["ep_degree"] == 2
    for key in EXPERT_KEYS:  # the unsplit model's names and shapes, split along E
        assert index["tensors"][key]["shape"][0] == EXPERTS, key
        assert sorted(index["tensors"][key]["parts"]) == ["0", "1"], key
        assert index["tensors"][f"optim.exp_avg.{key}"]["shape"][0] == EXPERTS, key
    run_distributed(_leg, 3, 1, "os_g", 2, 1, a, b)
    run_distributed(_leg, 4, 4, "os", 3, 1, b)
    run_distributed(_leg, 2, 2, "os", 2, 2, a, c, "async")
    model = tiny_moe("mixtral", EXPERTS, seed=7)  # one process, no process group
    opt = _adamw(model)
    zerokit.checkpoint.load(c, model, opt)
    _same(model.state_dict(), _want(4), "async_save at ep 2, loaded in one process")
    assert opt.state[model.model.layers[1].mlp.experts.gate_up_proj]["step"] == 4


def test_dcp_out_fsdp2_names_and_in_at_another_ep(tmp_path):
    """DCP written at world 2 ep 2: torch's own get_state_dict / dcp.load / set_state_dict of
    the unsplit model resume it in one process; zerokit loads it at world 4 ep 4."""
    path = str(tmp_path / "dcp")
    _want(4)
    run_distributed(_leg, 2, 2, "os_g", 0, 2, None, path, "dcp")
    model = tiny_moe("mixtral", EXPERTS, seed=7)
    opt = _adamw(model)
    msd, osd = get_state_dict(model, opt)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in EXPERT_KEYS:
        assert tuple(meta[f"model.{key}"].size) == tuple(msd[key].shape), key
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert opt.state[model.model.layers[0].mlp.experts.down_proj]["step"] == 2
    for tokens in TOKENS[2:]:
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    _same(model.state_dict(), _want(4), "dcp.load in one process")
    run_distributed(_leg, 4, 4, "p_g_os", 2, 2, path)


@pytest.mark.slow
def test_dcp_saved_by_torch_loads_into_split_experts(tmp_path):
    """One process's get_state_dict after 2 steps, dcp.save'd, resumed at world 2 ep 2."""
    path = str(tmp_path / "dcp")
    model = tiny_moe("mixtral", EXPERTS)
    opt = _adamw(model)
    for tokens in TOKENS[:2]:
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path, no_dist=True)
    _want(4)
    run_distributed(_leg, 2, 2, "p_g_os", 2, 2, path)


def _experts_read(name: str, lo: int, hi: int, per_expert: int) -> set[int] | None:
    """The experts whose values a read of ``[lo, hi)`` of ``name`` holds (None: no expert's):
    a 3-D tensor's rows, or the expert a per-expert tensor's name says."""
    per_file = re.fullmatch(r".*experts\.(\d+)\..*", name)
    if per_file:
        return {int(per_file.group(1))}
    if name in EXPERT_KEYS:
        return set(range(lo // per_expert, (hi - 1) // per_expert + 1))
    return None


def _reads_its_experts(rank, world, path, ep):
    """load_pretrained into split experts: the values exact, each rank's reads of experts
    inside its own experts, every expert element read by one rank."""
    reads = _recording(ShardFile, "pread_into")  # (name, lo, hi) of the file's tensors
    model, _ = _model(ep, "p_g_os", seed=7)
    zerokit.checkpoint.load_pretrained(model, path)
    want = tiny_moe("mixtral", EXPERTS, seed=3).state_dict()
    _same(full_state_dict(model), want, "load_pretrained", atol=0)
    part = dist.get_rank() % ep  # the ep rank: neighbouring ranks split the experts
    mine = set(range(part * EXPERTS // ep, (part + 1) * EXPERTS // ep))
    per_expert = {k: want[k][0].numel() for k in EXPERT_KEYS}
    read = torch.zeros((), dtype=torch.int64)
    for name, lo, hi in reads:
        experts = _experts_read(name, lo, hi, per_expert.get(name, 0))
        if experts is not None:
            assert experts <= mine, f"rank {rank} (ep part {part}) read {name} [{lo}, {hi})"
            read += hi - lo
    dist.all_reduce(read)
    assert read.item() == sum(want[k].numel() for k in EXPERT_KEYS)  # each element once


@pytest.mark.parametrize(
    "files, ep",
    [("per_expert", 2), pytest.param("merged", 4, marks=pytest.mark.slow)],
    ids=["hf-per-expert-ep2", "3d-ep4"],
)
def test_load_pretrained_reads_only_a_ranks_experts(tmp_path, files, ep):
    """``files``: what save_pretrained writes (one tensor per expert, the layout of the
    models' published files), or the 3-D parameters as the model names them."""
    plain = tiny_moe("mixtral", EXPERTS, seed=3)
    plain.save_pretrained(tmp_path, save_original_format=files == "per_expert")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        per_expert = any(".experts.0.w1." in n for n in f.keys())
    assert per_expert == (files == "per_expert"), "the layout this case is about"
    run_distributed(_reads_its_experts, 4, str(tmp_path), ep)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_per_expert_files_read_as_the_3d_experts(tmp_path, family):
    """No process group: what save_pretrained writes for each family the plan knows, seen
    through ``per_expert_sources``, is the model's own state dict, every file tensor used."""
    from safetensors.torch import load_file

    from zerokit.moe.state_dict import per_expert_sources

    model = tiny_moe(family, EXPERTS)
    model.save_pretrained(tmp_path)
    files = load_file(str(tmp_path / "model.safetensors"))
    merged = per_expert_sources({k: list(v.shape) for k, v in files.items()})
    used = {n for parts, _ in merged.values() for n in parts}
    seen = {k: v for k, v in files.items() if k not in used}
    for name, (parts, shape) in merged.items():
        seen[name] = torch.cat([files[n].reshape(-1) for n in parts]).view(shape)
    _same(seen, model.state_dict(), family, atol=0)


def _save_split(rank, world, path, level, whole_file):
    model, opt = _model(2, level)
    if level is not None:
        train_ranks(model, opt, TOKENS[:2], rank, world)
    zerokit.checkpoint.save(path, model, opt if level else None)
    whole = full_state_dict(model)
    if rank == 0:
        torch.save(whole, whole_file)


def test_consolidate_to_a_directory_from_pretrained_loads(tmp_path):
    """Saved at world 4 ep 2 'p_g_os' (expert pieces) and bare (each ep part held whole by
    2 ranks: one writes it), consolidated by ``zerokit ckpt consolidate`` (and the bare one
    converted to HF): from_pretrained holds exactly what the ranks held."""
    import transformers

    from zerokit.tools.cli import main as cli

    for level in ("p_g_os", None):
        path, out = str(tmp_path / f"ckpt-{level}"), str(tmp_path / f"hf-{level}")
        whole_file = str(tmp_path / f"whole-{level}.pt")
        run_distributed(_save_split, 4, path, level, whole_file)
        assert cli(["ckpt", "inspect", path]) == 0
        assert cli(["ckpt", "consolidate", path, out, "--max-shard-size", "20KB"]) == 0
        loaded = transformers.MixtralForCausalLM.from_pretrained(out).state_dict()
        _same(loaded, torch.load(whole_file), f"consolidated, level {level}", atol=0)
    as_hf = str(tmp_path / "as-hf")  # and converted
    assert cli(["ckpt", "convert", path, as_hf, "--to", "hf"]) == 0
    loaded = transformers.MixtralForCausalLM.from_pretrained(as_hf).state_dict()
    _same(loaded, torch.load(whole_file), "converted to a HF directory", atol=0)


# -- torchao's low-bit states on split experts ---------------------------------------------------
def _lowbit(ep: int, seed: int = 0):
    """The tiny Mixtral, experts 64 wide (``down_proj`` 4 x 16 x 64: 4096 values, quantized as
    one process does, ``gate_up_proj`` 8192), AdamW8bit over the whole model, 'os_g'."""
    import torchao.optim

    model = tiny_moe("mixtral", EXPERTS, seed=seed, inner=64)
    if ep > 1:
        apply_expert_parallel(model, init_expert_groups(ep))
    opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-2, eps=1e-6)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os_g", segment_size=10)
    return model, opt


def _lowbit_leg(rank, world, ep, path, want_path):
    """ep given with ``want_path`` None: 2 steps, save (codes and scales, at their place in
    the unsplit tensors), a third step, its whole model written to ``path``.pt. Else: load
    at ``ep``, the third step, equal to the uninterrupted run's."""
    model, opt = _lowbit(ep, seed=7 if want_path else 0)
    if want_path is None:
        train_ranks(model, opt, TOKENS[:2], rank, world)
        zerokit.checkpoint.save(path, model, opt)
    else:
        zerokit.checkpoint.load(path, model, opt)
    held, quantized = low_bit_expert_pieces(model, opt)
    assert held and quantized == held, f"ep {ep}: {sorted(held - quantized)} not quantized"
    train_ranks(model, opt, TOKENS[2:3], rank, world)
    got = _whole(model, ep)
    if want_path is None:
        if rank == 0:
            torch.save(got, path + ".pt")
        return
    _same(got, torch.load(want_path), f"AdamW8bit saved at ep 2, loaded at ep {ep}", atol=1e-6)


def test_lowbit_states_of_split_experts_round_trip(tmp_path):
    """AdamW8bit's quantized states of split experts, saved at world 2 ep 2 and loaded at
    world 2 ep 2 and ep 1 (each rank's part starts and ends on a block): the step after the
    load is the uninterrupted run's."""
    pytest.importorskip("torchao")
    path = str(tmp_path / "ckpt")
    run_distributed(_lowbit_leg, 2, 2, path, None)
    with open(os.path.join(path, "index.json")) as f:
        tensors = json.load(f)["tensors"]
    for key in EXPERT_KEYS:  # the unsplit tensors' codes (a byte a value) and scales
        numel = math.prod(tensors[key]["shape"])
        assert tensors[f"optim.exp_avg:codes.{key}"]["shape"] == [numel], key
        assert tensors[f"optim.exp_avg:scale.{key}"]["shape"] == [numel // 256], key
    for ep in (2, 1):
        run_distributed(_lowbit_leg, 2, ep, path, path + ".pt")


def _train_sgd(model, opt, tokens_list, rank, world):
    for tokens in tokens_list:
        per = tokens.shape[0] // world
        mine = tokens[rank * per : (rank + 1) * per]
        model(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()


def _wrapped_sgd(ep, level, state=None):
    """A fresh model, its experts split over ep of the world's ranks, loaded from ``state``."""
    model = tiny_moe("mixtral")
    apply_expert_parallel(model, init_expert_groups(ep))
    if state is not None:
        load_full_state_dict(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
    return model, opt


def _full_state_round_trip(rank, world, tmp):
    tokens = batches(4, 4)
    ref = tiny_moe("mixtral")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _train_sgd(ref, ref_opt, tokens, 0, 1)
    model, opt = _wrapped_sgd(2, "p_g_os")
    _train_sgd(model, opt, tokens[:2], rank, world)
    saved = full_state_dict(model)
    if rank == 0:  # what from_pretrained loads: the plain model's own state dict
        plain = tiny_moe("mixtral", seed=1)
        plain.load_state_dict(saved)
        plain.save_pretrained(tmp)
    dist.barrier()
    import transformers

    loaded = transformers.MixtralForCausalLM.from_pretrained(tmp).state_dict()
    for k, v in saved.items():
        torch.testing.assert_close(loaded[k], v, atol=0, rtol=0)
    model, opt = _wrapped_sgd(4, "os_g", saved)  # ep 2 -> ep 4
    _train_sgd(model, opt, tokens[2:], rank, world)
    _same(full_state_dict(model), ref.state_dict(), "ep 2 -> ep 4")
    new = dist.new_group([0, 1])  # ep 2 -> ep 1 at world 2: the first two ranks alone
    if rank < 2:
        model = tiny_moe("mixtral")
        model.load_state_dict(saved)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os", group=new)
        _train_sgd(model, opt, tokens[2:], rank, 2)
        _same(model.state_dict(), ref.state_dict(), "ep 2 -> ep 1")


def test_full_state_dict_ep2_to_ep4_and_ep1_and_from_pretrained(tmp_path):
    run_distributed(_full_state_round_trip, 4, str(tmp_path))


def _unwrap(rank, world):
    model, opt = _wrapped_sgd(2, "p_g_os")
    _train_sgd(model, opt, batches(1, 2 * world), rank, world)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = zerokit.unwrap(model, opt)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 2  # this rank's 2 of 4 experts, whole again


def test_unwrap_gives_back_this_ranks_experts():
    run_distributed(_unwrap, 2)


def _save_bare_ep2(rank, world, path):
    model, _ = _model(2, None)
    zerokit.checkpoint.save(path, model)


def test_inspect_names_expert_splits_as_ep_parts(tmp_path):
    """``zerokit ckpt inspect`` of a checkpoint saved at ep 2 counts the split experts as ep
    parts, not as tensors split across tp ranks (there are none: ep runs with tp 1)."""
    path = str(tmp_path / "ep2")
    run_distributed(_save_bare_ep2, 2, path)
    report, ok = zerokit.checkpoint.describe(path)
    assert ok, report
    assert f"({len(EXPERT_KEYS)} split in 2 ep parts)" in report, report
    assert "tp ranks" not in report, report
