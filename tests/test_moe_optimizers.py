"""Optimizers on expert shards. AdamW is every other MoE test's; torchao's low-bit AdamW
(quantized states on the experts' blocks) is as close to one process as DDP is. A
whole-parameter optimizer on split experts is refused by name before anything changes:
torch's Adafactor factors its second moment per expert (the last two dims) but scales each
step by two norms of the whole [E, ...] parameter (``test_adafactor_reads_every_expert``), so
an owner of a rank's E / ep experts would not step as one process does (tried: 7.3e-5 from one
process after 3 steps at world 4, ep 2); torch's Muon refuses 3-D parameters itself, and an
expert-wise Muon would need each expert's 2-D matrix whole on one rank. Adafactor on the
dense parameters beside AdamW on the experts trains as one process does."""

import pytest
import torch
from dist_helpers import run_distributed
from moe_models import (
    assert_same_as_reference,
    batches,
    low_bit_expert_pieces,
    reference_copy,
    tiny_moe,
)

import zerokit
from zerokit.moe import apply_expert_parallel, init_expert_groups


def _pair(model):
    """AdamW on the experts, Adafactor on the rest."""
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    return [torch.optim.AdamW(experts, lr=1e-2), torch.optim.Adafactor(dense, lr=1e-2)]


def _mixed(rank, world, level):
    tokens = batches(3, 2 * world)
    model = tiny_moe("mixtral")
    ref = reference_copy(model)
    ref_opts = _pair(ref)
    for t in tokens:
        ref(input_ids=t, labels=t).loss.backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    apply_expert_parallel(model, init_expert_groups(2))
    model, opts, _ = zerokit.group_sharded_parallel(model, _pair(model), level, segment_size=10)
    for t in tokens:
        mine = t[2 * rank : 2 * rank + 2]
        model(input_ids=mine, labels=mine).loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    assert_same_as_reference(model, ref, 2e-5, f"AdamW + Adafactor world {world} ep 2 {level}")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["os_g", "p_g_os"])
def test_adafactor_dense_adamw_experts(level):
    run_distributed(_mixed, 4, level)


def _refused(rank, world):
    model = tiny_moe("mixtral")
    apply_expert_parallel(model, init_expert_groups(2))
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    first = "'model.layers.0.mlp.experts.gate_up_proj' is a rank's E / ep experts"
    with pytest.raises(ValueError, match=f"Adafactor reads each parameter whole, and {first}"):
        zerokit.group_sharded_parallel(model, opt, "os_g")
    assert not hasattr(opt, "_zerokit"), "nothing is changed by a refused call"
    # an expert-wise Muon (torch's refuses 3-D parameters) says it reads parameters whole
    muon = _ExpertMuon(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=f"_ExpertMuon reads each parameter whole, and {first}"):
        zerokit.group_sharded_parallel(model, muon, "os_g")


class _ExpertMuon(torch.optim.SGD):
    """Stands for a Muon orthogonalising each expert's 2-D matrix: whole-parameter, as its
    class says (``zerokit_whole_parameter``)."""

    zerokit_whole_parameter = True


def test_whole_parameter_optimizer_on_experts_refused():
    run_distributed(_refused, 2)


# -- torchao's low-bit states on expert shards ---------------------------------------------------
def _lowbit(rank, world, ep, level, name, inner=128):
    """torchao's ``name`` over the whole model, experts ``inner`` wide, so each layer's 3-D
    experts are quantized, in blocks, on the rank as in one process. 128 wide: ``gate_up_proj``
    4 x 256 x 16, ``down_proj`` 4 x 16 x 128, a rank's slice at ep 2 8192 and 4096 values. 64
    wide: ``down_proj`` 4096 values whole but 2048 a rank's, under torchao's 4096: torchao
    asks the tensor it is given, and one process quantizes the whole, so the core tells it the
    unsplit size (``Need.whole_numel``; before, the rank kept that state in fp32: RMS 9e-5
    from one process, DDP 1.6e-6). A last-bit difference of a reduced gradient can flip a
    low-bit code, as under DDP: as close to one process as DDP (the whole model on every
    rank) is, ``test_optimizers``' rule: max within 2e-5, else RMS within 4x DDP's. Measured
    (world 2, AdamW8bit, 'os_g'): RMS 2.0e-6, DDP 1.5e-6."""
    import torchao.optim
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make(m):
        return getattr(torchao.optim, name)(list(m.parameters()), lr=1e-2, eps=1e-6)

    tokens = batches(3, 2 * world, constant_rows=1)
    model = tiny_moe("mixtral", inner=inner)
    ref, ddp = reference_copy(model), DDP(reference_copy(model))
    _train_one(ref, [make(ref)], tokens, 0, 1)
    _train_one(ddp, [make(ddp)], tokens, rank, world)
    apply_expert_parallel(model, init_expert_groups(ep))
    model, opt, _ = zerokit.group_sharded_parallel(model, make(model), level, segment_size=10)
    _train_one(model, [opt], tokens, rank, world)
    held, quantized = low_bit_expert_pieces(model, opt)
    assert held and quantized == held, f"{name}: {sorted(held - quantized)} not quantized"
    (ours, ours_rms), (theirs, theirs_rms) = _rms_distance(model, ref), _rms_distance(ddp, ref)
    what = f"{name} {inner} wide, world {world} ep {ep} {level}: {ours:.2e} (rms {ours_rms:.2e})"
    what += f", DDP {theirs:.2e} (rms {theirs_rms:.2e})"
    print(what, flush=True)
    assert ours <= 2e-5 or ours_rms <= 4 * theirs_rms, what


def _train_one(model, opts, tokens_list, rank, world):
    per = tokens_list[0].shape[0] // world
    for tokens in tokens_list:
        mine = tokens[rank * per : (rank + 1) * per]
        model(input_ids=mine, labels=mine).loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()


def _rms_distance(model, ref) -> tuple[float, float]:
    """(max, RMS) over every element, a rank's experts against the same experts of ``ref``."""
    from zerokit.moe import ExpertParallelExperts

    model = getattr(model, "module", model)
    split = {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    diffs = []
    for name, want in ref.state_dict().items():
        owner = name.rpartition(".")[0]
        if owner in split:
            first = split[owner].first_expert
            want = want[first : first + split[owner].num_local_experts]
        diffs.append((model.state_dict()[name] - want).reshape(-1))
    d = torch.cat(diffs)
    return d.abs().max().item(), d.square().mean().sqrt().item()


@pytest.mark.parametrize("inner", [128, 64])  # 64: a rank's down_proj under 4096, its whole not
def test_adamw8bit_on_expert_shards(inner):
    pytest.importorskip("torchao")
    run_distributed(_lowbit, 2, 2, "os_g", "AdamW8bit", inner)


def test_lowbit_part_off_the_blocks_refused():
    """A rank's part of a quantized parameter that does not end on a block of the unsplit one
    cannot be quantized as one process does: refused by name, before anything changes."""
    from zerokit.core.optimizer_needs import Need, with_whole_numel

    needs = {1: Need(block=256), 2: Need(block=256), 3: Need()}
    fine = with_whole_numel(needs, {1: ("a", 2048, 4096), 3: ("c", 100, 200)})
    assert fine[1].whole_numel == 4096 and fine[3].whole_numel is None
    with pytest.raises(ValueError, match=r"'b' \(2176 values on this rank, 4352 unsplit\)"):
        with_whole_numel(needs, {1: ("a", 2048, 4096), 2: ("b", 2176, 4352)})
    assert needs[1].whole_numel is None, "the needs given are not changed"


@pytest.mark.slow  # torchao compiles a step per piece shape: minutes on 2 CPU cores
@pytest.mark.parametrize("name,level", [("AdamW8bit", "p_g_os"), ("AdamW4bit", "os_g")])
def test_lowbit_on_expert_shards_world4(name, level):
    pytest.importorskip("torchao")
    run_distributed(_lowbit, 4, 2, level, name)


def test_adafactor_reads_every_expert():
    """Why Adafactor on a rank's E / ep experts is refused: torch's Adafactor on the two halves
    of a 3-D parameter is not Adafactor on the whole (its step size is the whole parameter's
    RMS, its update clipped by the whole update's RMS), although its factored second moment is
    per expert."""
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(4, 6, 5))
    halves = [torch.nn.Parameter(whole.detach()[:2].clone() * 3), torch.nn.Parameter(
        whole.detach()[2:].clone())]  # fmt: skip
    with torch.no_grad():
        whole[:2] *= 3  # the experts differ in scale, as trained experts do
    grad = torch.randn(4, 6, 5)
    whole.grad, halves[0].grad, halves[1].grad = grad.clone(), grad[:2].clone(), grad[2:].clone()
    torch.optim.Adafactor([whole], lr=1e-2).step()
    torch.optim.Adafactor(halves, lr=1e-2).step()
    apart = (torch.cat([h.detach() for h in halves]) - whole.detach()).abs().max().item()
    assert apart > 1e-4, f"Adafactor on the halves is Adafactor on the whole ({apart:.1e})"
