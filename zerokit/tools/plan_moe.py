"""``zerokit plan --ep N``: expert parallelism in the dry run. Each played rank splits the
model's experts over its ep group (``zerokit.moe.apply_expert_parallel``, the real code)
against the stand-in groups, and runs the real dispatch and combine all-to-alls; the
routing is assumed, since the dry run has no values (``zerokit.moe.dispatch.assumed_route``):
every rank sends its tokens' assignments evenly over the ep ranks, and receives
``imbalance`` x the mean (max / mean tokens a rank receives; 1.0: uniform routing), as the
busiest rank would.

Reported per rank and step: the bytes handed to the all-to-alls (dispatch and combine,
forward and backward; a rank keeps 1/ep of them under even splits), and the parameter,
gradient and optimizer bytes of the experts (sharded over the expert-data-parallel ranks)
beside the dense ones (over every rank), counted as ``zerokit.memory.measure`` counts.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..core import as_optimizer_list, state_of
from ..memory import StorageCounter, format_bytes
from ..moe import ExpertParallelExperts, apply_expert_parallel, init_expert_groups

BUILT_IN = "built-in Mixtral"
_A2A = "all_to_all"


def builtin_factory(experts: int, top_k: int) -> Callable[[], nn.Module]:
    """A tiny Hugging Face Mixtral (hidden 64, 2 layers, intermediate 128, vocabulary 256)
    with ``experts`` experts, ``top_k`` a token; its experts' own forward is transformers'
    ``batched_mm`` (no value-dependent shapes: the plan's fake-tensor forward runs it)."""

    def mixtral() -> nn.Module:
        import transformers as tf

        config = tf.MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
            num_experts_per_tok=top_k, max_position_embeddings=512, tie_word_embeddings=False,
            experts_implementation="batched_mm",
        )  # fmt: skip
        config._attn_implementation = "eager"
        return tf.MixtralForCausalLM(config)

    return mixtral


def check_moe(cfg) -> None:
    """Refuse what ``--ep`` does not plan yet, before anything is played."""
    if cfg.ep == 1 and cfg.moe_imbalance == 1.0:
        return
    if not isinstance(cfg.ep, int) or cfg.ep < 2 or cfg.world % cfg.ep:
        raise ValueError(
            f"--ep {cfg.ep} must be at least 2 and divide --world {cfg.world} (--moe-imbalance "
            "needs --ep)"
        )
    if cfg.tp > 1 or cfg.pp > 1 or (cfg.sharding_degree or cfg.world) != cfg.world:
        raise ValueError(
            "--ep is planned with plain data parallelism only (no --tp, --pp or "
            "--sharding-degree), as zerokit.moe composes with it"
        )
    if not 1.0 <= cfg.moe_imbalance <= cfg.ep:
        raise ValueError(
            f"--moe-imbalance {cfg.moe_imbalance} is max / mean tokens a rank receives: at "
            f"least 1 (uniform routing) and at most --ep = {cfg.ep} (one rank receives all)"
        )
    if not cfg.model and (cfg.experts % cfg.ep or not 1 <= cfg.top_k <= cfg.experts):
        raise ValueError(
            f"the built-in Mixtral's --experts {cfg.experts} must be a multiple of --ep "
            f"{cfg.ep}, and --top-k {cfg.top_k} between 1 and --experts"
        )


def moe_report(cfg, played: dict) -> dict:
    """The report's ``moe`` entry: rank 0's all-to-all bytes (every rank's under the assumed
    routing) and each rank's experts and dense bytes, alike ranks grouped."""
    by_memory: dict[str, tuple[list[int], dict]] = {}
    for rank in sorted(played):
        memory = {k: played[rank].moe[k] for k in ("experts", "dense")}
        by_memory.setdefault(repr(memory), ([], memory))[0].append(rank)
    experts = played[0].moe["num_experts"]
    return {
        "ep": cfg.ep,
        "micro_batches": cfg.accumulation,  # the all-to-alls below run once in each
        "imbalance": cfg.moe_imbalance,
        "experts": experts,
        "experts_per_rank": experts // cfg.ep,
        "all_to_all": all_to_all_bytes(played[0].calls),
        "memory_by_ranks": [(",".join(map(str, r)), m) for r, m in by_memory.values()],
    }


def split_experts(model: nn.Module, ep: int, imbalance: float) -> dict[int, str]:
    """Split ``model``'s experts over ep groups of the stand-in world, routing assumed;
    the roles of the two expert groups, by id. Collective (on stand-ins: no waiting)."""
    groups = init_expert_groups(ep)
    for module in apply_expert_parallel(model, groups):
        module.assumed_imbalance = imbalance
    return {id(groups.ep_group): "ep", id(groups.expert_dp_group): "experts"}


def expert_dense_bytes(model: nn.Module, optimizer, held) -> dict[str, dict[str, int]]:
    """The experts' parameter, gradient and optimizer bytes on this rank (their parameters,
    the buckets holding them, those buckets' gradient buffers, their optimizer state), and
    the dense rest: ``held`` (``measure``'s) less the experts'. The staging buffers the
    units share count as dense."""
    split = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    mine = {id(p) for m in split for p in m.parameters()}
    params = [p for p in model.parameters() if id(p) in mine]
    groups = [g for g in state_of(model).groups if any(id(p) in mine for p in g.params)]
    buckets = [b for g in groups for b in g.buckets]
    grads = [p.grad for p in params] + [t for g in groups for t in g.grads_to_scale()]
    # the optimizer steps the buckets' pieces (views of their shards) in the parameters' place
    stepped = mine | {id(v) for b in buckets for v in b.param_pieces}
    inners = [getattr(o, "optim", o) for o in as_optimizer_list(optimizer)]
    state = [v for o in inners for p, s in o.state.items() if id(p) in stepped
             for v in s.values()]  # fmt: skip
    experts = {
        "params": _count([p.data for p in params] + [b.shard_data for b in buckets]),
        "grads": _count(grads),
        "optimizer": _count(state),
    }
    totals = {"params": held.params, "grads": held.grads, "optimizer": held.optimizer}
    dense = {k: totals[k] - experts[k] for k in totals}
    return {"experts": experts, "dense": dense, "num_experts": split[0].num_experts}


def _count(tensors) -> int:
    """Bytes of the distinct storages among ``tensors`` (``measure``'s way)."""
    return StorageCounter()(tensors)


def all_to_all_bytes(calls) -> dict[str, int]:
    """The bytes this rank handed to the ep group's all-to-alls in a step, from its recorded
    ``(role, call)``s: the routing counts, and each exchange of tokens. A forward runs, per
    MoE layer, the dispatch then the combine; the backward their reverses in reverse order:
    the combine's, then the dispatch's."""
    out = dict.fromkeys(
        ("counts", "dispatch_forward", "combine_forward", "combine_backward",
         "dispatch_backward"), 0,
    )  # fmt: skip
    seen = {"forward": 0, "backward": 0}
    for role, c in calls:
        if role != "ep" or c.op != _A2A:
            continue
        if not c.dtype.is_floating_point:
            out["counts"] += c.bytes
            continue
        order = ("dispatch", "combine") if c.phase == "forward" else ("combine", "dispatch")
        out[f"{order[seen[c.phase] % 2]}_{c.phase}"] += c.bytes
        seen[c.phase] += 1
    return out


def purpose(c) -> str:
    """What an ep group's call is for (``zerokit.tools.plan``'s table)."""
    if not c.dtype.is_floating_point:
        return "expert parallel: routing counts"
    return f"expert parallel: tokens' all-to-all ({c.phase})"


def format_moe(moe: dict, world: int) -> list[str]:
    """The printout's MoE section."""
    ep, a2a, k = moe["ep"], moe["all_to_all"], moe.get("micro_batches", 1)
    # with accumulation every micro-batch exchanges its tokens, no_sync or not
    per = "step" if k == 1 else f"micro-batch ({k} a step, every way to accumulate)"
    lines = [
        "",
        f"expert parallelism: ep {ep} (each rank {moe['experts_per_rank']} of a layer's "
        f"{moe['experts']} experts, sharded over {world // ep} ranks; dense over {world}); "
        f"routing assumed: a rank receives {moe['imbalance']:g} x the mean tokens "
        "(--moe-imbalance, max / mean; 1 = uniform), sending its own evenly",
        f"  all-to-all bytes per rank per {per} (handed to all_to_all_single; {ep - 1}/{ep} "
        "leave the rank under even splits):",
    ]
    for what in ("dispatch", "combine"):
        fwd, bwd = a2a[f"{what}_forward"], a2a[f"{what}_backward"]
        lines.append(
            f"    {what:<9} forward {format_bytes(fwd):>11}   backward {format_bytes(bwd):>11}"
        )
    lines.append(f"    routing counts {format_bytes(a2a['counts'])}")
    lines.append(f"  {'':<9}{'params':>12}{'grads':>12}{'optimizer':>12}  per rank")
    rows: dict[str, list[str]] = {}  # ranks whose figures print alike share a row
    for ranks, memory in moe["memory_by_ranks"]:
        for kind in ("experts", "dense"):
            m = memory[kind]
            figures = "".join(f"{format_bytes(m[k]):>12}" for k in ("params", "grads", "optimizer"))
            rows.setdefault(f"  {kind:<9}{figures}", []).append(ranks)
    lines += [f"{row}  ranks {','.join(ranks)}" for row, ranks in rows.items()]
    return lines
