"""Pipeline parallelism in ``zerokit plan`` (``--pp P``): each stage's memory and the collectives
of one step of ``PipelineModule.forward_backward`` with ZeRO over the stage's data-parallel
ranks, then ``optimizer.step()``.

Every figure of a rank is read from its dry run (``zerokit.tools.dry_run_pp``): the pipeline
built on meta, its stage wrapped and trained two steps against stand-in groups, so the
transfers, gathers, reductions, tied weights' sums and the loss are what the code issues, and
the memory what ``measure`` counts. Ranks holding the same pieces of the same stage are played
once. What is estimated on fake tensors, as without a pipeline: each stage's units and buckets
(``core.units``), the largest transient (``zerokit.tools.plan.transient_bytes``, plus every
tensor the stage sent, which the mailbox holds until the schedule ends) and the activations:
one micro-batch's saved bytes (each stage's forward on fake tensors) times the most
micro-batches the schedule holds at once (``schedules.peak_in_flight``).
tests/test_plan.py holds the plan to real 2- and 4-rank steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import LevelRules
from ..memory import paper_bytes_per_step
from ..mixed_precision import MixedPrecision
from ..models.gpt import gpt_layers
from ..pipeline.module import PipelineStage
from ..pipeline.partition import partition
from ..pipeline.schedules import peak_in_flight, schedule
from .dry_run import Job
from .dry_run_pp import open_pipeline, run_stage_rank
from .plan import (
    LOW,
    Collective,
    _fake_workload,
    _purpose,
    _real_batch,
    _Unit,
    _units,
    aggregate,
    check_config,
    holding,
    report_head,
    saved_bytes,
    to_compute_dtype,
    transient_bytes,
)
from .plan import plan_with_calls as plain_plan
from .workload import check_pipeline_model, load_factory


@dataclass(frozen=True)
class StagePlan:
    """One stage as built and run on fake tensors."""

    stage: int
    layers: tuple[int, int]  # [first, end) in the whole model's layer list
    units: list[_Unit]
    params: int  # trainable parameters of the stage
    activations: int  # saved for backward by one micro-batch (the loss too on the last)


def gpt_stage_layers(model, what: str) -> list:
    """The built-in GPT's (or a preset's) layers for ``PipelineModule``."""
    check_pipeline_model(model, what)
    return gpt_layers(model.cfg)


def build_stages(layers: list, pp: int) -> tuple[list[int], list[PipelineStage]]:
    """The split ``PipelineModule`` makes by default and every stage's module (no group)."""
    bounds = partition(layers, pp, "parameters")
    stages = [PipelineStage(layers[bounds[s] : bounds[s + 1]], bounds[s]) for s in range(pp)]
    return bounds, stages


def stage_transient(plan: StagePlan, level: str, sent: int) -> dict:
    """``zerokit.tools.plan.transient_bytes`` plus what the mailbox holds until the schedule
    ends: ``sent``, every tensor the stage sent (headers included), as its dry run sent them."""
    out = transient_bytes(plan.units, level)
    out["sent"] = sent
    out["total"] += sent
    return out


def in_flight(actions_of: str, num_stages: int, stage: int, micro_batches: int) -> int:
    return peak_in_flight(schedule(actions_of, num_stages, stage, micro_batches))


def check_pp(pp: int, world: int, tp: int, micro_batches: int, rows: int, precision) -> None:
    if pp < 1 or world % pp:
        raise ValueError(f"--pp {pp} must be at least 1 and divide --world {world}")
    if pp > 1 and tp > 1:
        raise ValueError(
            "--pp with --tp: models.gpt.gpt_layers has no tensor-parallel layers yet; plan one "
            "of them at a time"
        )
    if pp > 1 and precision == "fp16":
        raise ValueError(
            "--pp with fp16: the loss scaler's agreement over the stages is not planned yet; "
            "plan bf16 or fp32"
        )
    if micro_batches < 1 or rows % micro_batches:
        raise ValueError(
            f"--micro-batches {micro_batches} must be at least 1 and divide the {rows} rows "
            "each data-parallel rank runs (--batch / data-parallel ranks)"
        )


def make_plan(cfg) -> dict:
    """``zerokit plan``'s report for any ``PlanConfig``: with ``pp`` > 1 the pipeline's."""
    return plan_with_calls(cfg)[0]


def plan_with_calls(cfg) -> tuple[dict, dict[int, list[Collective]]]:
    """The report and, per stage, a rank's step collectives one by one (pp 1: stage 0's are
    ``zerokit.tools.plan``'s)."""
    if cfg.pp == 1:
        report, calls = plain_plan(cfg)
        return report, {0: calls}
    check_config(cfg)
    per_stage = cfg.world // cfg.pp
    degree = cfg.sharding_degree or per_stage
    m = cfg.micro_batches or cfg.pp
    batch = cfg.batch if cfg.batch is not None else per_stage * m
    check_pp(cfg.pp, cfg.world, cfg.tp, m, batch // per_stage, cfg.mixed_precision)
    factory, psi, plans = _stage_plans(cfg, degree, batch // per_stage // m)
    job = Job(
        world=cfg.world, level=cfg.level, tp=1, degree=degree, seq=cfg.seq,
        rows=batch // per_stage, low=LOW[cfg.mixed_precision], optimizer=cfg.optimizer,
        buffer_max_size=cfg.buffer_max_size, segment_size=cfg.segment_size, pp=cfg.pp,
    )  # fmt: skip
    played = _play_stages(job, cfg, factory, plans, m)
    return _report(cfg, plans, played, psi, degree, batch, m)


def _stage_plans(cfg, degree: int, rows: int) -> tuple:
    """The factory, the whole model's parameter count and each stage's ``StagePlan``: the
    split ``PipelineModule`` makes, each stage built and run forward on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    policy = MixedPrecision(param_dtype=LOW[cfg.mixed_precision])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        factory = load_factory(cfg.model)
        plain = _fake_workload(factory, cfg.seq, 1)
        psi = sum(p.numel() for p in plain.model.parameters())
        layers = gpt_stage_layers(plain.model, cfg.model or "the built-in GPT")
        loss_fn = plain.loss_fn  # the workload's, as without a pipeline (fp32 cross-entropy)
        bounds, stages = build_stages(layers, cfg.pp)
        x, y = (mode.from_tensor(t) for t in _real_batch(plain, rows))
        plans = []
        for s, stage in enumerate(stages):
            units, _ = _units(stage, cfg, policy, degree)
            saved, out = _stage_forward(stage, x, policy, loss_fn if s == cfg.pp - 1 else None, y)
            trainable = sum(p.numel() for p in stage.parameters() if p.requires_grad)
            plans.append(StagePlan(s, (bounds[s], bounds[s + 1]), units, trainable, saved))
            x = out.detach()
    return factory, psi, plans


def _play_stages(job: Job, cfg, factory, plans: list[StagePlan], m: int) -> dict:
    """Every rank's ``RankRun``, the stages in order (a stage's receives are answered with
    what the stage before it sent), ranks of a stage holding the same pieces played once."""
    open_pipeline()
    per_stage = cfg.world // cfg.pp
    played = {}
    for plan in plans:
        alike: dict[tuple, list[int]] = {}
        for rank in range(plan.stage * per_stage, (plan.stage + 1) * per_stage):
            alike.setdefault(holding(plan.units, (rank % per_stage) % job.degree), []).append(rank)
        for ranks in alike.values():
            run = run_stage_rank(job, ranks[0], factory, cfg.schedule, m)
            played.update(dict.fromkeys(ranks, run))
    return played


def _report(cfg, plans: list[StagePlan], played: dict, psi: int, degree: int, batch: int, m: int):
    per_stage = cfg.world // cfg.pp
    calls = {p.stage: _described(played[p.stage * per_stage], cfg.level) for p in plans}
    stages = [_stage_entry(cfg, p, calls[p.stage], m) for p in plans]
    ranks = []
    for rank in range(cfg.world):
        p = plans[rank // per_stage]
        memory = dict(played[rank].memory)
        memory.update(
            transient=stages[p.stage]["transient"]["total"],
            activations=p.activations * stages[p.stage]["micro_batches_in_flight"],
        )
        described = _described(played[rank], cfg.level)
        ranks.append(
            {
                "rank": rank,
                "stage": p.stage,
                "memory": memory,
                "collectives": aggregate(described),
                "bytes_per_step": round(sum(c.sent for c in described)),
            }
        )
    report = {
        "params": psi,
        **report_head(cfg, degree, batch),
        "tp": 1,
        "pp": cfg.pp,
        "micro_batches": m,
        "schedule": cfg.schedule,
        "buckets": sum(s["buckets"] for s in stages),
        "units": sum(s["units"] for s in stages),
        "transient": max((s["transient"] for s in stages), key=lambda t: t["total"]),
        "paper_bytes_per_step": max(s["paper_bytes_per_step"] for s in stages),
        "stages": stages,
        "ranks": ranks,
        "played_ranks": sorted({run.rank for run in played.values()}),
    }
    return report, calls


def _stage_entry(cfg, p: StagePlan, calls: list[Collective], m: int) -> dict:
    """A stage's row of the report."""
    per_stage = cfg.world // cfg.pp
    psi_stage = sum(b.numel for u in p.units for b in u.layouts)
    itemsize = LOW[cfg.mixed_precision].itemsize if cfg.mixed_precision else 4
    sent = sum(c.bytes for c in calls if c.op == "send")
    return {
        "stage": p.stage,
        "layers": list(p.layers),
        "params": p.params,
        "ranks": [p.stage * per_stage, (p.stage + 1) * per_stage - 1],
        "units": len(p.units),
        "buckets": sum(len(u.layouts) for u in p.units),
        "activations_per_micro_batch": p.activations,
        "micro_batches_in_flight": in_flight(cfg.schedule, cfg.pp, p.stage, m),
        "transient": stage_transient(p, cfg.level, sent),
        "paper_bytes_per_step": paper_bytes_per_step(cfg.level, psi_stage, per_stage, itemsize),
    }


def _described(run, level: str) -> list[Collective]:
    """A played rank's calls as ``Collective``s: the pipeline's own named by the dry run
    (transfers, the tied weights' sum, the loss), zerokit's as without a pipeline."""
    shard_params = LevelRules.decode(level).shard_params
    out = []
    for role, c in run.calls:
        zerokits = role in ("shard", "replicas", "model")
        what = _purpose(role, c, shard_params) if zerokits else role
        pair = c.op in ("send", "recv")  # point to point: between two ranks of the group
        out.append(Collective(c.op, 2 if pair else c.group_size, c.bytes, what))
    return out


def _stage_forward(stage, x, policy: MixedPrecision, loss_fn, y):
    """One micro-batch through ``stage`` on fake tensors: the bytes autograd saves (each
    storage once, parameters left out; the loss too on the last stage) and the output."""
    to_compute_dtype(stage, policy)
    if x.is_floating_point():
        x = x.detach().requires_grad_()  # as PipelineModule makes a received input
    with saved_bytes(stage) as seen:
        out = stage(x)
        if loss_fn is not None:
            loss_fn(out, y)
    return sum(seen.values()), out
