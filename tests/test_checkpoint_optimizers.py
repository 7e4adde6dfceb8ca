"""Checkpoints of a list of optimizers and of the optimizers that read more than one element:
saved at one world size and level, loaded at another, training goes on as one process that
never stopped.

* Muon + AdamW (a list) saved at 'p_g_os' x 2, loaded at 'os_g' x 3: Muon's momentum is held
  whole by each matrix's owner, and the owners differ between the two layouts.
* Adafactor saved at 'os' x 3, loaded at 'p_g_os' x 2: its ``row_var`` (m, 1) and ``col_var``
  (1, n) are not shaped like the parameter; the new owner gets them whole.
* torchao's AdamW8bit saved at world 2, loaded at world 3: codes and scales exactly as saved
  (each piece starts on a block, so its codes and scales are slices of the whole ones).

Tolerance: 2e-5, with Muon's Newton-Schulz in fp32 (``test_optimizers.py`` derives why: in
bf16 a last-bit difference of a reduced gradient flips roundings in every run, DDP's too).
"""

import os

import pytest
import torch
from dist_helpers import run_distributed
from models import MatrixNet, global_batches, local_slice, loss_fn, make_optimizers
from test_optimizers import newton_schulz_in_fp32

import zerokit
from zerokit.checkpoint import CheckpointError
from zerokit.core.state import state_of

ATOL = 2e-5
BATCH = 6  # divides among 2 and 3 ranks
OPTIONS = {"os": {"buffer_max_size": 500}, "os_g": {"buffer_max_size": 500}}
OPTIONS["p_g_os"] = {"segment_size": 10}


@pytest.fixture
def muon_in_fp32():
    """Muon's Newton-Schulz in fp32 while the test runs (its ranks are forked from this
    process and inherit it)."""
    with newton_schulz_in_fp32():
        yield


def _train(model, opts, batches, rank: int, world: int) -> None:
    for x, y in batches:
        loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()


def _wrapped(kind: str, level: str, seed: int, **net):
    torch.manual_seed(seed)  # the load phase starts from other values: the load replaces them
    model = MatrixNet(**net)
    return zerokit.group_sharded_parallel(
        model, make_optimizers(kind, model), level, **OPTIONS[level]
    )[:2]


def _save_phase(rank, world, kind, level, path, batches, format="zerokit"):
    model, opts = _wrapped(kind, level, seed=0)
    _train(model, opts, batches, rank, world)
    zerokit.checkpoint.save(path, model, opts, format=format)


def _load_phase(rank, world, kind, level, path, batches, want):
    model, opts = _wrapped(kind, level, seed=1)
    zerokit.checkpoint.load(path, model, opts)
    _train(model, opts, batches, rank, world)
    got = model.state_dict()  # collective at 'p_g_os'
    for name, value in want.items():
        torch.testing.assert_close(
            got[name], value, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{kind}: {n}: {m}"
        )


def _one_process(kind: str, batches) -> dict:
    torch.manual_seed(0)
    model = MatrixNet()
    _train(model, make_optimizers(kind, model), batches, 0, 1)
    return model.state_dict()


@pytest.mark.parametrize(
    "kind, saved_at, loaded_at",
    [("muon", ("p_g_os", 2), ("os_g", 3)), ("adafactor", ("os", 3), ("p_g_os", 2))],
)
def test_resumed_at_another_world_and_level_trains_as_one_process(
    kind, saved_at, loaded_at, tmp_path, muon_in_fp32
):
    batches = global_batches(6, batch=BATCH)
    want = _one_process(kind, batches)
    path = str(tmp_path / "ckpt")
    (level, world), (level2, world2) = saved_at, loaded_at
    run_distributed(_save_phase, world, kind, level, path, batches[:3])
    run_distributed(_load_phase, world2, kind, level2, path, batches[3:], want)


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_a_dcp_checkpoint_of_these_optimizers_resumes_as_one_process(kind, tmp_path, muon_in_fp32):
    """The same in torch's DCP format: a list of optimizers (their param groups in order, as
    ``get_state_dict(model, optimizers=...)`` lists them), Adafactor's row and column
    statistics read whole by each parameter's new owner."""
    batches = global_batches(6, batch=BATCH)
    want = _one_process(kind, batches)
    path = str(tmp_path / "dcp")
    run_distributed(_save_phase, 2, kind, "p_g_os", path, batches[:3], "dcp")
    run_distributed(_load_phase, 3, kind, "os_g", path, batches[3:], want)


# -- refusals -------------------------------------------------------------------------------
def _refusals(rank, world, path):
    model, opts = _wrapped("muon", "os_g", seed=0)
    _train(model, opts, global_batches(1, batch=BATCH), rank, world)
    zerokit.checkpoint.save(path, model, opts)
    model2, opts2 = _wrapped("muon", "os_g", seed=1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    for given, named in (([opts2[1]], "given 1"), (opts2[::-1], "['AdamW', 'Muon']")):
        with pytest.raises(CheckpointError, match=r"2 optimizer\(s\) \['Muon', 'AdamW'\]") as e:
            zerokit.checkpoint.load(path, model2, given)
        assert named in str(e.value) and "same order" in str(e.value), str(e.value)
        assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())
        assert not any(o.state for o in opts2), "a refused load changed the optimizer"
    zerokit.checkpoint.load(path, model2, opts2)  # the same list: loads
    assert all(o.state for o in opts2)


def test_a_list_loads_only_into_the_same_optimizers_in_the_same_order(tmp_path):
    run_distributed(_refusals, 2, str(tmp_path / "ckpt"))


def _save_for_lightning(rank, world, path):
    model, opts = _wrapped("muon", "p_g_os", seed=0)
    _train(model, opts, global_batches(1, batch=BATCH), rank, world)
    zerokit.checkpoint.save(path, model, opts, extra={"lightning/epoch": 3})


def test_offline_tools_read_a_list_as_lightning_stores_several_optimizers(tmp_path):
    """``zerokit ckpt inspect`` names each optimizer; the Lightning file holds one
    ``optimizer_states`` entry per optimizer, each numbering its own parameters from 0."""
    from zerokit.checkpoint.lightning_file import consolidate_lightning

    path = str(tmp_path / "ckpt")
    run_distributed(_save_for_lightning, 2, path)
    report, ok = zerokit.checkpoint.describe(path)
    assert ok and "optimizer 0: Muon" in report and "optimizer 1: AdamW" in report, report
    (out,) = consolidate_lightning(path, tmp_path / "out.ckpt")
    states = torch.load(out, weights_only=False)["optimizer_states"]
    torch.manual_seed(0)
    muon, adamw = make_optimizers("muon", MatrixNet())
    for saved, opt in zip(states, (muon, adamw)):
        numbered = [n for g in saved["param_groups"] for n in g["params"]]
        assert numbered == list(range(sum(len(g["params"]) for g in opt.param_groups)))
    assert {k for s in states[0]["state"].values() for k in s} == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= {k for s in states[1]["state"].values() for k in s}
    shapes = [tuple(states[0]["state"][i]["momentum_buffer"].shape) for i in range(4)]
    assert shapes == [(73, 24), (24, 73)] * 2, shapes


def test_convert_of_several_optimizers_says_to_leave_them_out(tmp_path):
    """``zerokit ckpt convert`` carries one optimizer; a checkpoint of a list is refused by
    name (not a TypeError deep inside), and ``--no-optimizer`` converts its model."""
    from zerokit.checkpoint.convert import convert

    path = str(tmp_path / "ckpt")
    run_distributed(_save_for_lightning, 2, path)
    with pytest.raises(CheckpointError, match=r"2 optimizers.*--no-optimizer"):
        convert(path, str(tmp_path / "dcp"), "dcp")
    assert not os.path.exists(tmp_path / "dcp")
    convert(path, str(tmp_path / "dcp"), "dcp", False)
    assert os.path.isfile(tmp_path / "dcp" / ".metadata")


def _one_optimizer_both_ways(rank, world, path):
    """A checkpoint of one optimizer keeps the format of one (a dict: what checkpoints saved
    before lists hold, version 2 included) and loads into a list of one, and back."""
    from zerokit.checkpoint.index import seal
    from zerokit.checkpoint.reading import CheckpointReader

    model, (opt,) = _wrapped("adafactor", "os", seed=0)
    _train(model, [opt], global_batches(2, batch=BATCH), rank, world)
    zerokit.checkpoint.save(path, model, opt)
    if rank == 0:  # as a version-2 zerokit wrote it: the same fields, the older version
        with CheckpointReader(path) as reader:
            index = reader.index
        assert isinstance(index["optimizer"], dict), "one optimizer: one entry, as before"
        with open(os.path.join(path, "index.json"), "wb") as f:
            f.write(seal(index | {"format_version": 2}))
    torch.distributed.barrier()
    model2, opts2 = _wrapped("adafactor", "os", seed=1)
    zerokit.checkpoint.load(path, model2, opts2)  # a list of one
    for (_, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b)
    for p, q in zip(opt.param_groups[0]["params"], opts2[0].param_groups[0]["params"]):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opts2[0].state[q][key]), key


def test_one_optimizer_keeps_its_format_and_loads_into_a_list_of_one(tmp_path):
    run_distributed(_one_optimizer_both_ways, 2, str(tmp_path / "ckpt"))


# -- torchao's block-quantized states -------------------------------------------------------
LOWBIT_NET = {"dim": 64, "hidden": 128}  # 64 x 128 = 8192 values: quantized (>= 4096)


def _lowbit(cls: str, model):
    import torchao.optim

    params = [p for p in model.parameters() if p.requires_grad]
    return getattr(torchao.optim, cls)(params, lr=1e-2, eps=1e-6)


def _lowbit_wrapped(cls: str, level: str, seed: int):
    torch.manual_seed(seed)
    model = MatrixNet(**LOWBIT_NET)
    return zerokit.group_sharded_parallel(model, _lowbit(cls, model), level, **OPTIONS[level])[:2]


def _pieces_state(model, opt) -> dict:
    """(name, start of the piece) -> its state, each quantized one as (codes, scale)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for bucket in state_of(model).buckets:
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            state = {}
            for key, value in opt.state[view].items():
                if hasattr(value, "codes"):  # the codes' bytes (fp8 codes too) and scales
                    value = (value.codes.reshape(-1).view(torch.uint8).clone(), value.scale.clone())
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
            out[(names[id(bucket.params[piece.slot])], piece.start)] = state
    return out


def _lowbit_save(rank, world, cls, path, batches):
    model, opt = _lowbit_wrapped(cls, "os", seed=0)
    _train(model, [opt], batches, rank, world)
    zerokit.checkpoint.save(path, model, opt)
    torch.save(_pieces_state(model, opt), f"{path}.rank{rank}.pt")


def _whole_states(path: str, world: int) -> dict:
    """(name, key) -> the whole parameter's (codes, scale), assembled from the saved pieces."""
    whole: dict = {}
    for r in range(world):
        for (name, start), state in torch.load(f"{path}.rank{r}.pt").items():
            for key, value in state.items():
                if isinstance(value, tuple):
                    whole.setdefault((name, key), {})[start] = value
    return {  # the pieces of a parameter, in order, are all of it
        nk: tuple(torch.cat([part[i] for _, part in sorted(parts.items())]) for i in (0, 1))
        for nk, parts in whole.items()
    }


def _lowbit_load(rank, world, cls, path, saved_world, batch, want):
    model, opt = _lowbit_wrapped(cls, "p_g_os", seed=1)
    zerokit.checkpoint.load(path, model, opt)
    whole = _whole_states(path, saved_world)
    checked = 0
    for (name, start), state in _pieces_state(model, opt).items():
        for key, value in state.items():
            if isinstance(value, tuple):
                codes, scale = whole[(name, key)]
                n, blocks = value[0].numel(), value[1].numel()
                per_code = 2 if cls == "AdamW4bit" else 1  # 4-bit: two values to a byte
                block = n * per_code // blocks
                at = start // per_code
                assert torch.equal(value[0], codes[at : at + n]), f"{name} {key} codes"
                assert torch.equal(value[1], scale[start // block : start // block + blocks])
                checked += 1
    assert checked > 0, "no quantized state was loaded"
    _train(model, [opt], [batch], rank, world)
    got = model.state_dict()  # collective
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cls", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_lowbit_states_reload_exactly_at_another_world_size(cls, tmp_path):
    """Codes and scales saved at world 2 ('os') are, at world 3 ('p_g_os'), each piece's slice
    of the saved ones bit for bit; one more step equals one process resumed from the same
    checkpoint (its update reads the fp32 states before they are quantized again)."""
    pytest.importorskip("torchao")
    path = str(tmp_path / "ckpt")
    batches = global_batches(3, batch=BATCH)
    run_distributed(_lowbit_save, 2, cls, path, batches[:2])
    # one process resumes from the same checkpoint (a bare model: the whole codes and scales)
    torch.manual_seed(2)
    ref = MatrixNet(**LOWBIT_NET)
    ref_opt = _lowbit(cls, ref)
    zerokit.checkpoint.load(path, ref, ref_opt)
    assert any(hasattr(v, "codes") for s in ref_opt.state.values() for v in s.values())
    _train(ref, [ref_opt], batches[2:], 0, 1)
    run_distributed(_lowbit_load, 3, cls, path, 2, batches[2], ref.state_dict())


def test_lowbit_state_loads_only_with_the_blocks_it_was_saved_in(tmp_path):
    """One process: a bare AdamW8bit's state reloads bit for bit; with another block_size
    (blocks of 128 would cut the saved scales wrongly) the load is refused, changing nothing;
    the Lightning file refuses it (Lightning would need pickled torchao tensors)."""
    from torchao.optim import AdamW8bit

    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = MatrixNet(**LOWBIT_NET)
    opt = _lowbit("AdamW8bit", model)
    _train(model, [opt], global_batches(1, batch=BATCH), 0, 1)
    zerokit.checkpoint.save(path, model, opt, extra={"lightning/epoch": 0})
    from zerokit.checkpoint.lightning_file import consolidate_lightning

    with pytest.raises(CheckpointError, match=r"block-quantized .* resume from the checkpoint"):
        consolidate_lightning(path, tmp_path / "out.ckpt")  # would pickle torchao tensors
    same = AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    zerokit.checkpoint.load(path, model, same)
    for p, state in opt.state.items():
        for key, value in state.items():
            got = same.state[p][key]
            if hasattr(value, "codes"):
                assert torch.equal(got.codes, value.codes) and torch.equal(got.scale, value.scale)
            else:
                assert torch.equal(got, value), key
    other = AdamW8bit([p for p in model.parameters() if p.requires_grad], block_size=128)
    with pytest.raises(CheckpointError, match=r"blocks of 256.*same optimizer class and block"):
        zerokit.checkpoint.load(path, model, other)
    assert not other.state
