"""Pipeline parallelism in ``zerokit plan`` (``--pp P``): each stage's memory and the collectives
of one step of ``PipelineModule.forward_backward`` with ZeRO over the stage's data-parallel
ranks, then ``optimizer.step()``.

What is zerokit's own code run here: the layer list (``models.gpt.gpt_layers``), the split
(``pipeline.partition``, ``PipelineModule``'s default ``"parameters"``), each stage's
``PipelineStage`` built on fake tensors, its units and buckets (``core.units``, as in
``zerokit.tools.plan``), the schedule's actions (``pipeline.schedules``), and each stage's forward on
fake tensors, which gives the shapes sent between stages and the bytes autograd saves. What is
written out from the pipeline's and the core's rules (``docs/ARCHITECTURE.md``, "Pipeline
parallelism"), and held to real 2- and 4-rank steps by tests/test_plan.py:

- per forward: the receive of the input (a 10-int64 header, then the tensor) on every stage
  but the first, the units' gathers ('p_g_os': the root unit only if the last backward freed
  it), the agreement on the units' order (below 'p_g_os'; stage 3 agrees it once, in the
  first step), the send of the output on every stage but the last;
- per backward: the receive of the output's gradient, the gathers of the backward ('p_g_os':
  every unit but a still-gathered root), and, on the stage's last backward unless the stage
  holds a copy of a weight tied across stages, the gradients' reduction; then every group is
  freed; the input's gradient is sent back;
- after the schedule: tied copies' gradients summed over the stages holding them, then the
  deferred reduction; the loss broadcast from the last stage and averaged over the data
  groups; the optimizer's step (below 'p_g_os': every bucket's updated shards gathered).

Memory: each stage's parameters, gradients and optimizer state as ``zerokit.tools.plan`` counts them
for the stage's own units; activations: one micro-batch's saved bytes times the most
micro-batches the schedule holds at once (``schedules.peak_in_flight``); the transient adds
what the mailbox holds until the schedule ends (every tensor the stage sent, with headers).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mixed_precision import MixedPrecision
from ..models.gpt import gpt_layers
from ..pipeline.describe import SharedLayerDesc
from ..pipeline.module import PipelineStage
from ..pipeline.partition import partition
from ..pipeline.schedules import peak_in_flight, schedule
from .plan import (
    LOW,
    Collective,
    Ops,
    _fake_workload,
    _real_batch,
    _Unit,
    _units,
    aggregate,
    check_config,
    rank_memory,
    report_head,
    saved_bytes,
    to_compute_dtype,
    transient_bytes,
)
from .plan import plan_with_calls as plain_plan
from .workload import check_pipeline_model, load_factory

HEADER_BYTES = 80  # p2p.py: a header of 10 int64 before every tensor sent
_LOSS_BYTES = 4  # the float32 mean loss, broadcast from the last stage and averaged


@dataclass(frozen=True)
class StagePlan:
    """One stage as built and run on fake tensors."""

    stage: int
    layers: tuple[int, int]  # [first, end) in the whole model's layer list
    units: list[_Unit]
    frozen: int
    params: int  # trainable parameters of the stage
    activations: int  # saved for backward by one micro-batch (the loss too on the last)
    input_bytes: int  # the tensor received per micro-batch (its gradient is sent back)
    output_bytes: int  # the tensor sent on per micro-batch (its gradient comes back)
    tied: tuple[tuple[int, int], ...]  # (stages holding the copy, bytes of its gradient)


def gpt_stage_layers(model, what: str) -> list:
    """The built-in GPT's (or a preset's) layers for ``PipelineModule``."""
    check_pipeline_model(model, what)
    return gpt_layers(model.cfg)


def build_stages(layers: list, pp: int) -> tuple[list[int], list[PipelineStage]]:
    """The split ``PipelineModule`` makes by default and every stage's module (no group)."""
    bounds = partition(layers, pp, "parameters")
    stages = [PipelineStage(layers[bounds[s] : bounds[s + 1]], bounds[s]) for s in range(pp)]
    return bounds, stages


def tied_stages(layers: list, bounds: list[int]) -> dict[str, list[int]]:
    """Each shared key on several stages -> those stages (as ``PipelineModule`` finds them)."""
    where: dict[str, list[int]] = {}
    for i, item in enumerate(layers):
        if isinstance(item, SharedLayerDesc):
            s = next(s for s in range(len(bounds) - 1) if i < bounds[s + 1])
            if s not in where.setdefault(item.key, []):
                where[item.key].append(s)
    return {k: v for k, v in sorted(where.items()) if len(v) > 1}


def stage_collectives(
    plan: StagePlan,
    num_stages: int,
    level: str,
    degree: int,
    replicas: int,
    actions_of: str,
    micro_batches: int,
) -> list[Collective]:
    """Rank of stage ``plan.stage``: the logical collectives of one step, in order."""
    s, units = plan.stage, plan.units
    ops = Ops(degree, replicas)
    first, last = s == 0, s == num_stages - 1
    deferred = bool(plan.tied)
    actions = schedule(actions_of, num_stages, s, micro_batches)
    last_b = max(k for k, a in enumerate(actions) if a.kind == "B")
    root_gathered = False
    p2p = ops.out.append

    def transfer(op: str, nbytes: int, what: str) -> None:
        p2p(Collective(op, 2, HEADER_BYTES, f"{what} (header)"))
        p2p(Collective(op, 2, nbytes, what))

    def gathers(when: str) -> None:
        nonlocal root_gathered
        if level != "p_g_os":
            return
        others = [u for u in units if not u.is_root]  # forward in order, backward reversed
        if not root_gathered:
            for u in units:
                if u.is_root:
                    ops.gather(u, when)
        for u in others if when == "forward" else reversed(others):
            ops.gather(u, when)
        root_gathered = True

    for k, action in enumerate(actions):
        if action.kind == "F":
            if not first:
                transfer("recv", plan.input_bytes, "receive activations")
            gathers("forward")
            if level != "p_g_os":  # stage 3 agrees once, then only when its order changes
                ops.agree_order()
            if not last:
                transfer("send", plan.output_bytes, "send activations")
        else:
            if not last:
                transfer("recv", plan.output_bytes, "receive gradients")
            gathers("backward")
            if k == last_b and not deferred:
                for u in reversed(units):
                    ops.reduce(u, level)
                ops.end_of_backward(units, None)
            root_gathered = False  # every backward ends by freeing every unit
            if not first:
                transfer("send", plan.input_bytes, "send gradients")
    for stages, nbytes in plan.tied:
        if stages > 1:
            ops.out.append(Collective("all_reduce", stages, nbytes, "sum tied weights' gradients"))
    if deferred:
        for u in reversed(units):
            ops.reduce(u, level)
        ops.end_of_backward(units, None)
    if num_stages > 1:
        ops.out.append(
            Collective("broadcast", num_stages, _LOSS_BYTES, "the loss, from the last stage")
        )
    for size in ops.data_groups:
        ops.add("all_reduce", size, _LOSS_BYTES, "the loss, averaged")
    ops.step(units, level)
    return ops.out


def stage_transient(plan: StagePlan, num_stages: int, level: str, micro_batches: int) -> dict:
    """``zerokit.tools.plan.transient_bytes`` plus what the mailbox holds until the schedule ends."""
    out = transient_bytes(plan.units, level)
    sent = 0
    if plan.stage < num_stages - 1:
        sent += micro_batches * (plan.output_bytes + HEADER_BYTES)
    if plan.stage > 0:
        sent += micro_batches * (plan.input_bytes + HEADER_BYTES)
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_config(cfg)
    low = LOW[cfg.mixed_precision]
    policy = MixedPrecision(param_dtype=low)
    per_stage = cfg.world // cfg.pp
    degree = cfg.sharding_degree or per_stage
    m = cfg.micro_batches or cfg.pp
    batch = cfg.batch if cfg.batch is not None else per_stage * m
    check_pp(cfg.pp, cfg.world, cfg.tp, m, batch // per_stage, cfg.mixed_precision)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        factory = load_factory(cfg.model)
        plain = _fake_workload(factory, cfg.seq, 1)
        psi = sum(p.numel() for p in plain.model.parameters())
        layers = gpt_stage_layers(plain.model, cfg.model or "the built-in GPT")
        loss_fn = plain.loss_fn  # the workload's, as without a pipeline (fp32 cross-entropy)
        bounds, stages = build_stages(layers, cfg.pp)
        tied = tied_stages(layers, bounds)
        x, y = (mode.from_tensor(t) for t in _real_batch(plain, batch // per_stage // m))
        plans = []
        for s, stage in enumerate(stages):
            units, frozen = _units(stage, cfg, policy, degree)
            saved, out = _stage_forward(stage, x, policy, loss_fn if s == cfg.pp - 1 else None, y)
            copies = [key for key, where in tied.items() if s in where]
            plans.append(
                StagePlan(
                    stage=s,
                    layers=(bounds[s], bounds[s + 1]),
                    units=units,
                    frozen=frozen,
                    params=sum(p.numel() for p in stage.parameters() if p.requires_grad),
                    activations=saved,
                    input_bytes=x.nbytes,
                    output_bytes=out.nbytes if s < cfg.pp - 1 else 0,
                    tied=tuple((len(tied[k]), _tied_grad_bytes(stage, k, layers)) for k in copies),
                )
            )
            x = out.detach()
    return _report(cfg, plans, psi, degree, batch, m)


def _report(cfg, plans: list[StagePlan], psi: int, degree: int, batch: int, m: int):
    per_stage = cfg.world // cfg.pp
    replicas = per_stage // degree
    calls, stages = {}, []
    for p in plans:
        calls[p.stage] = stage_collectives(p, cfg.pp, cfg.level, degree, replicas, cfg.schedule, m)
        held = in_flight(cfg.schedule, cfg.pp, p.stage, m)
        psi_stage = sum(b.numel for u in p.units for b in u.layouts)
        itemsize = LOW[cfg.mixed_precision].itemsize if cfg.mixed_precision else 4
        k = 3 if cfg.level == "p_g_os" else 2
        stages.append(
            {
                "stage": p.stage,
                "layers": list(p.layers),
                "params": p.params,
                "ranks": [p.stage * per_stage, (p.stage + 1) * per_stage - 1],
                "units": len(p.units),
                "buckets": sum(len(u.layouts) for u in p.units),
                "activations_per_micro_batch": p.activations,
                "micro_batches_in_flight": held,
                "transient": stage_transient(p, cfg.pp, cfg.level, m),
                "paper_bytes_per_step": round(
                    k * psi_stage * (per_stage - 1) / per_stage * itemsize
                ),
            }
        )
    ranks = []
    for rank in range(cfg.world):
        p = plans[rank // per_stage]
        memory = rank_memory(
            p.units, cfg.level, (rank % per_stage) % degree, p.frozen, cfg.optimizer
        )
        memory.update(
            transient=stages[p.stage]["transient"]["total"],
            activations=p.activations * stages[p.stage]["micro_batches_in_flight"],
        )
        ranks.append(
            {
                "rank": rank,
                "stage": p.stage,
                "memory": memory,
                "collectives": aggregate(calls[p.stage]),
                "bytes_per_step": round(sum(c.sent for c in calls[p.stage])),
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
    }
    return report, calls


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


def _tied_grad_bytes(stage, key: str, layers: list) -> int:
    """The tied copy's gradient, summed across stages in the compute dtype (``finalize.py``)."""
    attr = next(d.shared_weight_attr for d in layers if getattr(d, "key", None) == key)
    weight = getattr(stage.shared[key], attr)
    return weight.numel() * weight.element_size()
