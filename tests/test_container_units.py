"""Containers that are never called, at level 'p_g_os' (issue 42, item 3).

A module whose ``forward`` is ``nn.Module``'s own (``ModuleDict``, ``ModuleList``,
``ParameterList``, ``ParameterDict``) is never called, so no hook of it fires: it cannot be a
unit, which is gathered when its module runs. Blocks kept as an ``nn.ModuleDict`` inside an
``nn.ModuleList``, the forward reaching in (``b["ln"](x)``), train as one process with Muon on
the blocks' matrices beside AdamW; and a module that runs outside its unit's forward (where
the unit's parameters are empty) is refused by name, naming the module, the unit and why,
instead of torch's "Expected weight to be of same shape as normalized_shape, but got weight
of shape [0]".
"""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import VOCAB, assert_same_params, global_batches, local_slice, loss_fn
from test_optimizers import newton_schulz_in_fp32
from torch import nn

import zerokit
from zerokit import NotGatheredError
from zerokit.core import plan_units
from zerokit.core.state import state_of

STEPS = 4
# fp32 with Muon's Newton-Schulz in fp32 (tests/test_optimizers.py derives it): the ranks'
# gradients differ from one process's only in summation order
ATOL = 2e-5


class DictBlocks(nn.Module):
    """Blocks as ``nn.ModuleDict`` in an ``nn.ModuleList``; the model's forward reaches into
    them. A ``ParameterList`` gate inside each block and a ``ParameterDict`` scale at the top,
    read by the model's forward: containers too, never called."""

    def __init__(self, dim: int = 16, hidden: int = 40, blocks: int = 3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln": nn.LayerNorm(dim),
                    "mlp": nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)),
                    "gate": nn.ParameterList([nn.Parameter(torch.full((dim,), 0.5))]),
                }
            )
            for _ in range(blocks)
        )
        self.scales = nn.ParameterDict({"out": nn.Parameter(torch.ones(dim))})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # [B, T, dim]
        for b in self.blocks:
            x = x + b["gate"][0] * b["mlp"](b["ln"](x))
        return self.head(self.norm(x) * self.scales["out"])


def _muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon on the blocks' matrices, AdamW on the rest (as tests/models.make_optimizers)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrix = {n for n, p in named if p.dim() == 2 and n.startswith("blocks.")}
    return [
        torch.optim.Muon([p for n, p in named if n in matrix], lr=0.02, momentum=0.9),
        torch.optim.AdamW(
            [p for n, p in named if n not in matrix], lr=1e-2, weight_decay=0.1, eps=1e-6
        ),
    ]


@pytest.mark.parametrize("segment_size", [10, 2**20])
def test_a_never_called_container_is_never_a_unit(segment_size):
    model = DictBlocks()
    plans = plan_units(model, list(model.named_parameters()), segment_size=segment_size)
    names = {plan.name for plan in plans}
    for plan in plans:  # every unit's module is called: a hook of it fires
        assert type(plan.module).forward is not nn.Module.forward, plan.name
    for k in range(3):  # the blocks' parts are the units (children of a list's child)
        assert {f"blocks.{k}.ln", f"blocks.{k}.mlp"} <= names, names
        assert f"blocks.{k}" not in names
    root = next(plan for plan in plans if plan.name == "<root>")
    read_by_the_model = {"blocks.0.gate.0", "scales.out"}
    assert read_by_the_model <= {n for n, _ in root.params}


def _trains_as_one_process(rank, world):
    batches = global_batches(STEPS, batch=2 * world)
    for options in ({}, {"segment_size": 10}):  # 10: the norms and embedding are units too
        torch.manual_seed(0)
        ref = DictBlocks()
        model = copy.deepcopy(ref)
        ref_opts = _muon_and_adamw(ref)
        model, opts, _ = zerokit.group_sharded_parallel(
            model, _muon_and_adamw(model), "p_g_os", **options
        )
        units = [g.name for g in state_of(model).groups]
        assert "blocks.1.ln" in units and "blocks.1" not in units, units
        for x, y in batches:
            loss_fn(ref(x), y).backward()
            xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
            loss_fn(model(xs), ys).backward()
            for pair in (ref_opts, opts):
                for opt in pair:
                    opt.step()
                for opt in pair:
                    opt.zero_grad()
        assert_same_params(model, ref, ATOL, f"p_g_os {options}, world {world}")


@pytest.mark.parametrize("world", [2, 3])
def test_modeldict_blocks_train_as_one_process_at_p_g_os(world):
    with newton_schulz_in_fp32():  # the ranks are forked from this process, patched
        run_distributed(_trains_as_one_process, world)


class ReachesIntoUnits(nn.Module):
    """Blocks as ``nn.Sequential`` (units: they have a forward), but the model's forward
    calls each block's first layer itself, outside the block's forward."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)) for _ in range(2)
        )
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block[1](block[0](x))  # block's forward never runs: it is never gathered
        return self.head(x)


def _refused_by_name(rank, world):
    torch.manual_seed(0)
    model = ReachesIntoUnits()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    x, _ = global_batches(1, batch=2 * world)[0]
    expected = (
        r"module 'blocks\.0\.0' \(LayerNorm\) ran while unit 'blocks\.0', which holds its "
        r"parameters \(blocks\.0\.0\.weight, blocks\.0\.0\.bias\), is not gathered: the unit "
        r"has not run since the last step.*called from inside 'blocks\.0''s forward"
    )
    with pytest.raises(NotGatheredError, match=expected):
        model(local_slice(x, rank, world))
    # every rank refused at the same call: the group is still usable, nothing hangs
    flag = torch.ones(1)
    dist.all_reduce(flag)
    assert flag.item() == world


def test_a_module_run_outside_its_units_forward_is_refused_by_name():
    run_distributed(_refused_by_name, 2)
