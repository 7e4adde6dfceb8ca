"""Expert parallelism judged by DDP's yardstick (issue 45 item 3): on the same run (the same
initial model, the same global batch, 3 AdamW steps, fp32), zerokit's distance from one
process holding the whole MoE is compared with the distance of torch's DDP (the whole model
on every rank, each rank its slice of the batch), instead of a fixed tolerance.

Both reorder sums one process does at once (DDP all-reduces gradients; zerokit also exchanges
tokens and reduces the experts over their own group), so neither is exactly one process.
Measured (max over parameters and losses, each rank's): world 2 ep 2 'p_g_os' zerokit 4.8e-7,
DDP 4.8e-7; world 3 ep 3 'os_g' 1.0e-5, DDP 1.2e-5; world 4 ep 2 'os' and 'p_g_os' 8.9e-7,
DDP 6.2e-7; world 4 ep 4 'os_g' 8.2e-7, DDP 6.2e-7: at most 1.43x DDP's. The bound is 2x DDP's
(plus 5e-8, for a run where DDP would land bit-equal). World 3 runs ep 3 (6 experts): ep
divides the data-parallel ranks, and 2 does not divide 3.

With the router's load-balancing loss on (``output_router_logits=True``), DDP averages each
rank's own aux loss, which is not the aux loss of the whole batch; zerokit's global aux loss
is. Measured at world 2, ep 2: DDP 4.5e-2 from one process, zerokit 2.0e-6 (the aux loss's
gradient through the router adds sums of its own); asserted: zerokit within 1e-5, DDP at
least 100x farther.
"""

import copy

import pytest
import torch
from dist_helpers import run_distributed
from moe_models import batches, tiny_moe, train_ranks, train_reference
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokit
from zerokit.moe import ExpertParallelExperts, apply_expert_parallel, init_expert_groups

STEPS = 3
FACTOR, FLOOR = 2.0, 5e-8


def _distance(model, ref, got_losses, want_losses) -> float:
    """The largest difference, over every parameter (a rank's experts against the same
    experts of the reference) and every step's loss."""
    split = {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    got, want = model.state_dict(), ref.state_dict()
    worst = max(abs(g - w) for g, w in zip(got_losses, want_losses))
    for name, value in want.items():
        owner = name.rpartition(".")[0]
        if owner in split:
            first = split[owner].first_expert
            value = value[first : first + split[owner].num_local_experts]
        worst = max(worst, (got[name].float() - value.float()).abs().max().item())
    return worst


def _ddp_run(model, tokens, rank, world):
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    losses = train_ranks(ddp, opt, tokens, rank, world)
    return ddp.module, losses


def _zerokit_run(model, tokens, rank, world, ep, level, aux):
    apply_expert_parallel(model, init_expert_groups(ep), aux_loss=aux)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
    return model, train_ranks(model, opt, tokens, rank, world)


def _distances(rank, world, ep, level, experts, aux, aux_mode="global"):
    """(zerokit's, DDP's) distance from one process on the same run."""
    tokens = batches(STEPS, 2 * world, constant_rows=1)
    model = tiny_moe("mixtral", experts, aux=aux)
    ref = copy.deepcopy(model)
    want = train_reference(ref, tokens)
    ddp_model, ddp_losses = _ddp_run(copy.deepcopy(model), tokens, rank, world)
    zk_model, zk_losses = _zerokit_run(model, tokens, rank, world, ep, level, aux_mode)
    return _distance(zk_model, ref, zk_losses, want), _distance(ddp_model, ref, ddp_losses, want)


def _judged(rank, world, ep, level, experts=4):
    zk, ddp = _distances(rank, world, ep, level, experts, aux=False)
    print(f"world {world} ep {ep} {level}: zerokit {zk:.2e}, DDP {ddp:.2e}", flush=True)
    assert zk <= FACTOR * ddp + FLOOR, f"zerokit {zk:.2e} from one process, DDP {ddp:.2e}"


CASES = [(2, 2, "p_g_os", 4), (3, 3, "os_g", 6), (4, 2, "os", 4), (4, 2, "p_g_os", 4),
         (4, 4, "os_g", 4)]  # fmt: skip


@pytest.mark.parametrize(
    "world,ep,level,experts",
    [pytest.param(*c, marks=() if c[0] == 2 else pytest.mark.slow) for c in CASES],
)
def test_within_ddp_distance(world, ep, level, experts):
    run_distributed(_judged, world, ep, level, experts)


def _aux(rank, world, ep):
    zk, ddp = _distances(rank, world, ep, "os_g", 4, aux=True)
    print(f"aux loss on, world {world} ep {ep}: zerokit {zk:.2e}, DDP {ddp:.2e}", flush=True)
    assert zk <= 1e-5, f"zerokit's global aux loss {zk:.2e} from one process"
    assert ddp >= 100 * zk, f"DDP {ddp:.2e} is not far from one process (zerokit {zk:.2e})"


def test_aux_loss_global_where_ddp_is_not():
    """The aux loss on: DDP (each rank's aux loss) ends far from one process; zerokit's global
    aux loss does not."""
    run_distributed(_aux, 2, 2)
