"""``zerokit plan``: what an N-rank job will hold and send, worked out on one CPU in seconds.

The ranks are played by ``zerokit.tools.dry_run``: this process becomes rank r of the job against
stand-in process groups (``core.stand_in``, which record every collective and complete it at
once), builds the model on ``meta`` (no bytes), and runs ``group_sharded_parallel`` and two
training steps, the real code. A rank's memory is what ``zerokit.memory.measure`` counts after
the second backward, its collectives are the ones recorded in that second step (the model's
own included), each a logical collective over a group (the stand-ins take the path NCCL takes:
one reduce-scatter, one all-gather; on gloo the core runs those as one reduce or broadcast per
rank, still one logical collective), its bytes counted as a ring would send them.

Ranks the layout says are alike (the same tp split, the same pieces of every bucket:
``holding``) are played once. The largest transient (gathered units and staged gradients at
once, ``transient_bytes``, from the core's decoding of the level) and the activations (what
autograd saves in a forward on fake tensors) are estimated, not measured. Pipelines (``--pp``)
are played by ``zerokit.tools.dry_run_pp`` (``zerokit.tools.plan_pp``). tests/test_plan.py
holds the plan to real 2- and 3-rank steps: the same ops, calls, bytes and memory.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..api import LEVELS
from ..config import ShardingConfig
from ..core import BucketLayout, LevelRules, UnitPlan, needs_of, plan_groups, plan_units
from ..core.stand_in import Call  # the dry run's records: the one deep import of the tools
from ..layout import Layout, init_hybrid_parallel
from ..memory import STATE_PER_PARAM, paper_bytes_per_step
from ..mixed_precision import PRECISIONS, MixedPrecision
from ..moe import expert_groups_of
from .dry_run import NO_VALUES, DryRunError, Job, RankRun, run_rank, stand_in_world
from .plan_links import link_bytes
from .plan_moe import BUILT_IN, builtin_factory, check_moe, moe_report, split_experts
from .plan_moe import purpose as ep_purpose
from .plan_optimizers import FLOPS_RULE, OPTIMIZERS, as_list
from .workload import accepts_layout, as_workload, load_factory, tp_workload

LOW = {None: None, **PRECISIONS}  # None: fp32
_AGREE_BYTES = 16  # an int64 pair [k, -k], MAX-reduced: the agreement all-reduces
_STEP_BYTES = 4  # torch's Adam/AdamW keep a float32 0-dim ``step`` tensor per parameter


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    world: int
    """Ranks of the job."""
    level: str
    """'os', 'os_g' or 'p_g_os'."""
    model: str | None = None
    """``pkg.module:factory`` (``zerokit.tools.workload``); None: ``zerokit compare``'s GPT."""
    sharding_degree: int | None = None
    """Hybrid sharding: shard over groups of this many ranks, replicate across the groups."""
    tp: int = 1
    """Tensor-parallel degree: each rank holds its tp slice; ZeRO over the world / tp ranks
    holding the same slice (the factory takes ``layout``, as for ``zerokit verify --tp``)."""
    pp: int = 1
    """Pipeline stages (``zerokit.tools.plan_pp``): the built-in GPT or a preset, split as
    ``PipelineModule`` splits ``models.gpt.gpt_layers``; ZeRO over each stage's world / pp ranks."""
    micro_batches: int | None = None
    """Micro-batches of a pipeline step (None: ``pp``)."""
    schedule: str = "1f1b"
    """The pipeline's schedule: '1f1b', 'fthenb' or 'naive'."""
    batch: int | None = None
    """Global batch in rows, split evenly across the ranks; None: one row per rank (per
    micro-batch under ``pp``)."""
    seq: int = 32
    """Tokens per sequence (token models)."""
    mixed_precision: str | None = None
    """'bf16' or 'fp16': compute copies in it, fp32 master shards (fp16: a loss scaler)."""
    optimizer: str = "adamw"
    """Which optimizer the ranks step (``zerokit.tools.plan_optimizers.OPTIMIZERS``: ``adamw``,
    ``sgd``, ..., ``muon`` (Muon for the blocks' matrices beside AdamW), ``adafactor``,
    ``adamw8bit``); its state is what ``measure`` counts, its step's FLOPs are reported."""
    buffer_max_size: int = 2**23
    segment_size: int = 2**20
    whole_grads: bool = False
    """Level 'os': all-reduce whole gradients (``ShardingConfig.whole_grads``, 3Ψ(N-1)/N a
    step) instead of the default reduce-scatter (the paper's 2Ψ(N-1)/N)."""
    accumulation: int = 1
    """Micro-batches per optimizer step (gradient accumulation). Above 1 the report gains
    ``links`` (``zerokit.tools.plan_links``): bytes per micro-batch and per step within a host
    and across hosts, reducing every micro-batch, under ``defer_replica_sync()`` and under
    ``no_sync()``."""
    shard_optimizer_over_replicas: bool = False
    """Hybrid sharding: the optimizer state sharded over the replicas too
    (``ShardingConfig.shard_optimizer_over_replicas``): 1/R of it per rank."""
    ep: int = 1
    """Expert parallelism (``zerokit.tools.plan_moe``): each MoE layer's experts split over
    this many ranks; the model a Hugging Face MoE model (None: a built-in tiny Mixtral)."""
    moe_imbalance: float = 1.0
    """Under ``ep``: the routing assumed, max / mean tokens a rank receives (1.0: uniform)."""
    experts: int = 8
    """The built-in Mixtral's experts per layer (under ``ep`` without ``model``)."""
    top_k: int = 2
    """The built-in Mixtral's experts per token."""


@dataclass(frozen=True)
class Collective:
    """One logical collective of a step; ``bytes`` is its whole tensor (a reduce-scatter's
    input, an all-gather's output)."""

    op: str  # "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv"
    group_size: int
    bytes: int
    what: str

    @property
    def sent(self) -> float:
        """Bytes each rank sends, by the ring algorithm."""
        if self.op in ("send", "recv"):  # point to point: the sender sends it all
            return self.bytes if self.op == "send" else 0
        n = self.group_size
        share = self.bytes * (n - 1) / n
        return 2 * share if self.op == "all_reduce" else share


@dataclass(frozen=True)
class _Unit:
    """One unit group's buckets, with the element sizes the core gives them."""

    name: str
    is_root: bool
    layouts: tuple[BucketLayout, ...]
    compute: int  # bytes per element of the full parameters (the compute copy)
    reduce: int  # bytes per element of the gradients as reduced
    master: int  # bytes per element of the shard the optimizer steps

    def full(self, per_element: int) -> int:
        return sum(b.padded_numel for b in self.layouts) * per_element


def check_config(cfg: PlanConfig) -> None:
    if cfg.level not in LEVELS:
        raise ValueError(f"--level must be one of {', '.join(LEVELS)}, got {cfg.level!r}")
    LevelRules.decode(cfg.level, whole_grads=cfg.whole_grads)  # refuses whole_grads but at 'os'
    if cfg.world < 1:
        raise ValueError(f"--world must be at least 1, got {cfg.world}")
    if cfg.tp < 1 or cfg.world % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must be at least 1 and divide --world {cfg.world}")
    if cfg.pp < 1 or cfg.world % (cfg.tp * cfg.pp):
        raise ValueError(f"--pp {cfg.pp} must be at least 1 and divide --world {cfg.world}")
    dp = cfg.world // (cfg.tp * cfg.pp)
    degree = cfg.sharding_degree or dp
    if degree < 1 or dp % degree:
        raise ValueError(
            f"--sharding-degree {degree} must be at least 1 and divide --world"
            + (f" / --tp = {dp}" if cfg.tp > 1 else "")
        )
    batch = cfg.batch if cfg.batch is not None else dp * (cfg.micro_batches or cfg.pp)
    if batch < 1 or batch % dp:
        raise ValueError(
            f"--batch {batch} must divide evenly across {dp} ranks"
            + (" (the data-parallel ones: --world / --tp)" if cfg.tp > 1 else "")
            + (" (the data-parallel ones of a stage: --world / --pp)" if cfg.pp > 1 else "")
        )
    if cfg.accumulation < 1 or (cfg.accumulation > 1 and cfg.pp > 1):
        raise ValueError(
            f"--accumulation {cfg.accumulation} must be at least 1, and 1 with --pp (a "
            "pipeline's micro-batches are --micro-batches)"
        )
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}"
        )
    check_moe(cfg)
    if cfg.pp > 1 and cfg.optimizer not in STATE_PER_PARAM:
        raise ValueError(
            f"--pp plans elementwise optimizers only: --optimizer {cfg.optimizer} is planned "
            "by the dry run, without --pp"
        )


def make_plan(cfg: PlanConfig) -> dict:
    """The report: ``{"params", "world", "level", "ranks": [...]}`` and more (see
    docs/GUIDE.md, ``zerokit plan``)."""
    return plan_with_calls(cfg)[0]


def plan_with_calls(cfg: PlanConfig) -> tuple[dict, list[Collective]]:
    """The report and rank 0's step collectives one by one (the report aggregates them)."""
    check_config(cfg)
    if cfg.pp > 1:
        raise ValueError("--pp: use zerokit.tools.plan_pp.plan_with_calls, which plans pipelines")
    low = LOW[cfg.mixed_precision]
    dp = cfg.world // cfg.tp
    degree = cfg.sharding_degree or dp
    batch = cfg.batch if cfg.batch is not None else dp
    factory, psi_model, per_tp_rank = _tp_splits(cfg, degree, batch // dp)
    job = Job(
        world=cfg.world, level=cfg.level, tp=cfg.tp, degree=degree, seq=cfg.seq,
        rows=batch // dp, low=low, optimizer=cfg.optimizer, buffer_max_size=cfg.buffer_max_size,
        segment_size=cfg.segment_size, whole_grads=cfg.whole_grads,
        over_replicas=cfg.shard_optimizer_over_replicas, ep=cfg.ep, moe_imbalance=cfg.moe_imbalance,
    )  # fmt: skip
    played = _play_alike_once(job, cfg, factory, per_tp_rank)
    # alike ranks share their run: describe each once
    calls_of = {id(run): _described(run.calls, cfg.level) for run in played.values()}
    ranks = [_rank_entry(cfg, r, played[r], per_tp_rank, calls_of) for r in range(cfg.world)]
    units = per_tp_rank[0][0]
    psi = sum(b.numel for u in units for b in u.layouts)  # what ZeRO shards on a rank
    itemsize = low.itemsize if low is not None else units[0].master if units else 4
    links = {}
    if cfg.accumulation > 1:  # each way to accumulate, played: bytes by link
        sent = lambda call: Collective(call.op, call.group_size, call.bytes, "").sent  # noqa: E731
        links["links"] = link_bytes(job, factory, cfg.accumulation, sent)
        links["accumulation"] = cfg.accumulation
    if cfg.ep > 1:
        links["moe"] = moe_report(cfg, played)
    return {
        **links,
        "params": psi_model if cfg.tp > 1 or cfg.ep > 1 else psi,
        **report_head(cfg, degree, batch),
        "tp": cfg.tp,
        "buckets": sum(len(u.layouts) for u in units),
        "units": len(units),
        "transient": transient_bytes(units, cfg.level),
        "paper_bytes_per_step": paper_bytes_per_step(cfg.level, psi, dp, itemsize),
        "optimizer": cfg.optimizer,
        "shard_optimizer_over_replicas": cfg.shard_optimizer_over_replicas,
        "optimizer_flops_rule": FLOPS_RULE,
        "optimizer_flops_imbalance": _imbalance([r["optimizer_flops"] for r in ranks]),
        "ranks": ranks,
        "played_ranks": sorted({run.rank for run in played.values()}),
    }, calls_of[id(played[0])]


def _rank_entry(cfg: PlanConfig, rank: int, run: RankRun, per_tp_rank: dict, calls_of: dict):
    """Rank ``rank``'s row of the report: what its run (its own, or an alike rank's) held and
    sent, with the estimates."""
    units, _, activations = per_tp_rank[_tp_class(rank, cfg.tp)]
    memory = dict(run.memory)
    memory.update(transient=transient_bytes(units, cfg.level)["total"], activations=activations)
    calls = calls_of[id(run)]
    return {
        "rank": rank,
        "memory": memory,
        "collectives": aggregate(calls),
        "bytes_per_step": round(sum(c.sent for c in calls)),
        "optimizer_flops": run.flops,
        "host_memory": run.host,
    }


def _tp_splits(cfg: PlanConfig, degree: int, rows: int) -> tuple:
    """The factory, the whole model's parameter count, and for each tp split planned (every
    tp rank holds the first's but the last: tp ranks 0 and tp - 1) its (units, frozen bytes,
    activations), built and run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    policy = MixedPrecision(param_dtype=LOW[cfg.mixed_precision])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        # the built-in Mixtral under --ep without --model
        factory = builtin_factory(cfg.experts, cfg.top_k) if cfg.ep > 1 and not cfg.model else None
        factory = factory or load_factory(cfg.model)  # a ValueError: a usage error, as it is
        if cfg.tp > 1 and not accepts_layout(factory):
            raise ValueError(
                f"--tp {cfg.tp}: the factory {cfg.model} takes no 'layout' keyword (see "
                "zerokit.tools.workload: factory(layout=None) the plain model, "
                "factory(layout=layout) the tensor-parallel one)"
            )
        plain = _fake_workload(factory, cfg.seq, cfg.tp)
        psi_model = sum(p.numel() for p in plain.model.parameters())
        if cfg.tp == 1 and cfg.ep == 1:
            return factory, psi_model, {0: _figures(plain, cfg, policy, degree, rows, mode)}
    if cfg.ep > 1:  # the model a rank holds: its E / ep experts, units on the experts' group
        with stand_in_world(0, cfg.world), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            work = _fake_workload(factory, cfg.seq, 1)
            split_experts(work.model, cfg.ep, cfg.moe_imbalance)
            return factory, psi_model, {0: _figures(work, cfg, policy, degree, rows, mode)}
    splits = {}
    for t in sorted({0, cfg.tp - 1}):
        # tp rank t of the stand-in world: the tp layers' groups record their collectives
        # and the layers' own control values (the vocabulary ranges) are real, as in the dry run
        with stand_in_world(t, cfg.world):
            layout = init_hybrid_parallel(cfg.world // cfg.tp, cfg.tp)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                work = _fake_tp_workload(factory, cfg, layout, plain)
                splits[t] = _figures(work, cfg, policy, degree, rows, mode)
    return factory, psi_model, splits


def _figures(work, cfg: PlanConfig, policy: MixedPrecision, degree: int, rows: int, mode):
    """(units, frozen bytes, activations) of one tp split's model, on fake tensors."""
    units, frozen = _units(work.model, cfg, policy, degree)
    try:
        activations = _activation_bytes(work, rows, policy, mode, cfg.tp > 1)
    except Exception as e:
        raise DryRunError(
            f"the forward on fake tensors failed: {type(e).__name__}: {e}. {NO_VALUES}"
        ) from e
    return units, frozen, activations


def _imbalance(flops: list[int]) -> float:
    """max / mean over the ranks (1.0: perfectly even; 1.0 too when nothing is stepped)."""
    mean = sum(flops) / len(flops)
    return round(max(flops) / mean, 4) if mean else 1.0


def report_head(cfg: PlanConfig, degree: int, batch: int) -> dict:
    """What every report opens with: the job as asked for."""
    return {
        "world": cfg.world,
        "level": cfg.level,
        "sharding_degree": degree,
        "model": cfg.model or (BUILT_IN if cfg.ep > 1 else "built-in GPT"),
        "precision": cfg.mixed_precision or "fp32",
        "batch": batch,
        "seq": cfg.seq,
    }


def _tp_class(rank: int, tp: int) -> int:
    """Which tp split ``rank`` holds, of those planned: the last tp rank's, or the first's."""
    return tp - 1 if rank % tp == tp - 1 else 0


def _play_alike_once(job: Job, cfg: PlanConfig, factory, per_tp_rank: dict) -> dict:
    """Every rank's ``RankRun``, playing ranks the layout says are alike only once: alike
    ranks hold the same tp split and the same pieces of every bucket (``holding``)."""
    # the owner layout, or the state sharded over replicas too: each rank holds its own
    # under ep the experts' buckets differ by rank (the units above are the unsplit model's)
    if cfg.optimizer not in STATE_PER_PARAM or cfg.shard_optimizer_over_replicas or cfg.ep > 1:
        return {rank: run_rank(job, rank, factory) for rank in range(cfg.world)}
    alike: dict[tuple, list[int]] = {}
    for rank in range(cfg.world):
        t = _tp_class(rank, cfg.tp)
        units = per_tp_rank[t][0]
        g = (rank // cfg.tp) % job.degree
        # what a rank writes (its async save's staging) depends on its place too
        writes = (g == 0, rank // cfg.tp // job.degree == 0, rank % cfg.tp == 0)
        alike.setdefault((t, holding(units, g), writes), []).append(rank)
    played = {}
    for ranks in alike.values():
        played.update(dict.fromkeys(ranks, run_rank(job, ranks[0], factory)))
    return played


def holding(units: list[_Unit], g: int) -> tuple:
    """The sizes of what rank ``g`` of a shard group holds of each bucket under an elementwise
    optimizer: its shard and its pieces. Ranks holding the same hold the same bytes at every
    level, and send the same (every rank of a group takes part in each of its collectives)."""
    return tuple(
        (b.shard_numel, tuple(p.numel for p in b.pieces(g))) for u in units for b in u.layouts
    )


def _described(calls: list[tuple[str, Call]], level: str) -> list[Collective]:
    """The recorded calls of a step as ``Collective``s, each with what it is for (read from
    the group's role, the phase, the op and the dtype: control values are integers)."""
    shard_params = LevelRules.decode(level).shard_params
    return [
        Collective(c.op, c.group_size, c.bytes, _purpose(role, c, shard_params))
        for role, c in calls
    ]


def _purpose(role: str, c: Call, shard_params: bool) -> str:
    """What a call of zerokit's (or the model's) is for; ``shard_params``: the level frees
    parameters between uses (a backward all-gather gathers them, not spread gradients)."""
    if role == "ep":  # the tokens' exchange of expert parallelism
        return ep_purpose(c)
    if role == "experts":  # the experts' shard group: their units' collectives
        return "experts: " + _purpose("shard", c, shard_params)
    if role == "model":  # a group zerokit was not given: the model's own (or the world)
        return f"{c.op} ({c.phase})"
    if role == "tp" and not (c.phase == "step" and c.op == "all_reduce"):
        return "tensor parallel (forward, loss, backward)"
    replicas = "replicas: " if role == "replicas" else ""
    if c.op == "all_reduce" and c.dtype == torch.int64:
        return "agree on the units' order"
    if c.op == "all_reduce" and not c.dtype.is_floating_point:  # uint8 flags
        return "agree which parameters have gradients"
    if c.phase == "forward" and c.op == "all_gather":
        return "gather parameters (forward)"
    if c.phase == "backward" and c.op == "all_gather":
        if shard_params:
            return "gather parameters (backward)"
        return "replicas: spread reduced gradients"
    if c.phase == "backward" and c.op in ("reduce_scatter", "all_reduce"):
        return "replicas: reduce gradient shard" if replicas else "reduce gradients"
    if c.phase == "step" and c.op == "all_gather":  # replicas: each stepped a sub-shard
        return "replicas: gather updated sub-shards" if replicas else "gather updated shards"
    if c.phase == "step" and c.op == "all_reduce":
        return "loss scaler: agree on inf/nan"
    return f"{replicas}{c.op} ({c.phase})"


def _fake_workload(factory, seq: int, tp: int):
    """The plain model's workload, built on fake tensors (``factory(layout=None)`` under tp)."""
    torch.manual_seed(0)
    try:
        return as_workload(factory() if tp == 1 else factory(layout=None), seq)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"--model: building it on fake tensors failed: {e}") from e


def _fake_tp_workload(factory, cfg: PlanConfig, layout: Layout, plain):
    """tp rank ``layout.tp_rank``'s model, built on fake tensors."""
    torch.manual_seed(0)
    try:
        return tp_workload(factory, layout, plain)
    except Exception as e:
        raise ValueError(f"--model with --tp {cfg.tp}: building it failed: {e}") from e


def _units(model: nn.Module, cfg: PlanConfig, policy: MixedPrecision, degree: int):
    """The unit groups ``group_sharded_parallel`` would build, and the frozen bytes."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # where the optimizer needs shard boundaries (the owner layout), as group_sharded_parallel
    needs = needs_of(as_list(OPTIMIZERS[cfg.optimizer](model)))
    full_precision = policy.full_precision_modules if policy.param_dtype is not None else ()
    plans = plan_units(
        model,
        named,
        segment_size=cfg.segment_size,
        wrap=ShardingConfig().wrap,
        full_precision=full_precision,
        own_groups=expert_groups_of(model),  # split experts (plan --ep): their own group
    )
    units = []
    for plan, layouts in plan_groups(plans, degree, cfg.buffer_max_size, needs=needs):
        units.append(_unit(plan, layouts, policy, model))
    kept = {id(p) for m in model.modules() if isinstance(m, full_precision) for p in m.parameters()}
    frozen = 0
    for p in model.parameters():
        if not p.requires_grad:
            cast = policy.param_dtype is not None and p.is_floating_point() and id(p) not in kept
            frozen += p.numel() * (policy.param_dtype.itemsize if cast else p.element_size())
    return [u for u in units if u.layouts], frozen


def _unit(plan: UnitPlan, layouts, policy: MixedPrecision, model: nn.Module) -> _Unit:
    master = layouts[0].dtype.itemsize if layouts else 4
    low = None if plan.full_precision else policy.param_dtype
    compute = low.itemsize if low is not None else master
    reduce = policy.gradient_reduce_dtype()
    return _Unit(
        plan.name,
        plan.module is model,
        tuple(layouts),
        compute,
        reduce.itemsize if reduce is not None else compute,
        master,
    )


def transient_bytes(units: list[_Unit], level: str) -> dict:
    """The largest transient of a step, as the core decodes ``level``. Parameters sharded
    between uses (stage 3): the root unit (gathered from forward to the end of backward) and
    two units in a row (the one running and the one gathered ahead). Gradients sharded
    (stages 2, 3): the staged gradients of two groups in a row (one reducing, the next
    filling: ``MAX_GROUPS_IN_FLIGHT`` is 1)."""
    decoded = LevelRules.decode(level)
    others = [u for u in units if not u.is_root]
    gathered = staging = 0
    if decoded.shard_params:
        root = sum(u.full(u.compute) for u in units if u.is_root)
        gathered = root + _pair_max([u.full(u.compute) for u in others])
    if decoded.shard_grads:
        staging = _pair_max([u.full(u.reduce) for u in units])
    return {"gathered": gathered, "staging": staging, "total": gathered + staging}


def _pair_max(sizes: list[int]) -> int:
    if len(sizes) < 2:
        return sum(sizes)
    return max(a + b for a, b in itertools.pairwise(sizes))


def aggregate(collectives: list[Collective]) -> list[dict]:
    """One entry per (op, group size, purpose): calls and their bytes summed."""
    rows: dict[tuple, dict] = {}
    for c in collectives:
        row = rows.setdefault(
            (c.op, c.group_size, c.what),
            {"op": c.op, "group_size": c.group_size, "calls": 0, "bytes": 0, "what": c.what},
        )
        row["calls"] += 1
        row["bytes"] += c.bytes
    return list(rows.values())


def _activation_bytes(work, per_rank: int, policy: MixedPrecision, mode, tp: bool) -> int:
    """What autograd saves for backward in one forward and loss of a rank's micro-batch, each
    storage once, the parameters left out: counted on fake tensors, so kernels save what they
    would on the device (the ``zerokit.memory.measure_activations`` way, for any model).
    With ``tp`` the forward runs outside the fake mode (its tensors are still fake): a tensor
    the tp layers make from nothing (a control value, over a stand-in group) is then real."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    model = work.model
    to_compute_dtype(model, policy)
    x, y = (mode.from_tensor(t[:per_rank]) for t in _real_batch(work, per_rank))
    if policy.param_dtype is not None and x.is_floating_point():
        x = x.to(policy.param_dtype)
    with unset_fake_temporarily() if tp else contextlib.nullcontext():
        with saved_bytes(model) as seen:
            work.loss_fn(model(x), y)
    return sum(seen.values())


def to_compute_dtype(model: nn.Module, policy: MixedPrecision) -> None:
    """The compute copy of the parameters, as zerokit's buckets hold it under ``policy``."""
    if policy.param_dtype is None:
        return
    for m in model.modules():
        if not isinstance(m, policy.full_precision_modules):
            for p in m.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(policy.param_dtype)


@contextlib.contextmanager
def saved_bytes(model: nn.Module) -> Iterator[dict[int, int]]:
    """Inside: what autograd saves for backward, by storage (each once), the parameters of
    ``model`` left out; read the returned dict's values after the block."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def _real_batch(work, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``rows`` rows of step 0's batch, made on the CPU outside the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return work.make_batch(0, rows)


def summarize(report: dict) -> list[tuple[list[int], dict]]:
    """Ranks that are alike, grouped: [(ranks, their entry without "rank")]."""
    groups: list[tuple[list[int], dict]] = []
    for entry in report["ranks"]:
        body = {k: v for k, v in entry.items() if k != "rank"}
        for ranks, other in groups:
            if other == body:
                ranks.append(entry["rank"])
                break
        else:
            groups.append(([entry["rank"]], body))
    return groups
