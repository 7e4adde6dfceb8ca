"""``zerokit verify``: the equivalence principle as a command.

Trains the model (``zerokit.tools.workload``'s contract) on ``nproc`` ranks at a level, each rank on
its slice of the global batch, and beside it, on rank 0, the same model on one process on the
whole global batch; after every step the full parameters of both are compared.

What is judged after every step, against the yardstick of the same ranks: beside zerokit each
rank trains the same model as torch's DDP does (each gradient averaged over the ranks after
backward, in plain torch; mixed precision under ``torch.autocast``) on the same slice, with the
same optimizer. Averaging N slices'
gradients rounds differently from one gradient of the batch, and an optimizer can amplify the
last bit (AdamW divides by the gradient's own size), so DDP is not exact either:

- fp32: zerokit's distance from one process (the largest ``|element difference|`` of any
  parameter) must be within the absolute ``tolerance`` (default 2e-5) or within ``DDP_FACTOR``
  (2) times DDP's own distance.
- mixed precision: two low-precision runs rounded differently drift apart, so neither is the
  other's reference. Each is measured against exact fp32 training of the same model on one
  process: zerokit's RMS distance from it, over all parameter elements, must stay within
  ``tolerance`` times (default 4) that of the same policy on one process (zerokit at one rank),
  as tests/test_mixed_precision.py judges, or within 2 times DDP's.

Every forward runs after ``torch.manual_seed(1000 + step)`` on every rank and in the
references. Before training, one fp32 forward of the first batch checks the model itself: the
ranks' mean loss on their slices must be the loss of one process on the whole batch (up to
``FORWARD_TOLERANCE``, relative). A forward that reads the rank or draws random numbers per
row (dropout) fails that check: then DDP diverges as zerokit does, the yardstick means nothing,
the absolute tolerance is judged and the verdict blames the forward. Otherwise a FAIL names the
first tensor where zerokit diverged and DDP did not. With ``--tp`` or ``--pp`` no DDP runs: the
absolute tolerance alone is judged.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..api import LEVELS, group_sharded_parallel
from ..layout import init_hybrid_parallel
from ..mixed_precision import PRECISIONS, MixedPrecision
from ..pipeline.schedules import SCHEDULES
from ..runtime.teardown import hand
from ..scaler import ShardedGradScaler, step_and_zero
from ..tensor_parallel import gather_full_state_dict
from .launch import local_backend, spawn_local
from .plan_optimizers import muon_and_adamw, newton_schulz_in_fp32
from .verify_pp import PipelineTrainer
from .workload import (
    Workload,
    accepts_layout,
    build_workload,
    check_pipeline_model,
    load_factory,
    tp_workload,
)

FP32_TOLERANCE = 2e-5
MIXED_PRECISION_FACTOR = 4.0
DDP_FACTOR = 2.0  # zerokit may be this many times as far from one process as DDP is
# the ranks' mean loss of the first batch beside one process's, relative: a mean over slices
# rounds ~1e-7 apart in fp32; dropout or a forward reading the rank moves it by far more
FORWARD_TOLERANCE = 1e-4
OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
}
# built from the model (``zerokit.tools.plan_optimizers``): Muon for the blocks' matrices, AdamW else
WHOLE_MODEL_OPTIMIZERS = {"muon": muon_and_adamw}
LOW = {None: None, **PRECISIONS}
_RMS_FLOOR = 1e-9  # a one-process run that stayed exact: the distributed one must nearly too


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    level: str
    """'os', 'os_g' or 'p_g_os'."""
    model: str | None = None
    """``pkg.module:factory`` (``zerokit.tools.workload``); None: the built-in small GPT."""
    nproc: int = 2
    """Ranks to start."""
    tp: int = 1
    """Tensor-parallel degree: ``nproc // tp`` data-parallel replicas of ``tp`` ranks, ZeRO
    over each tp rank's dp group (``zerokit.tools.workload``: the factory takes ``layout``)."""
    pp: int = 1
    """Pipeline stages (``zerokit.tools.verify_pp``): the model, a ``zerokit.models.gpt.GPT``, as a
    ``PipelineModule`` of ``gpt_layers``; ZeRO over each stage's ``nproc // pp`` ranks."""
    micro_batches: int | None = None
    """Micro-batches of a pipeline step (None: ``pp``)."""
    schedule: str = "1f1b"
    """The pipeline's schedule: '1f1b', 'fthenb' or 'naive'."""
    steps: int = 4
    """Training steps compared."""
    batch: int = 8
    """Global batch (rows); split evenly across the ranks."""
    seq: int = 32
    """Tokens per sequence (token models only)."""
    mixed_precision: str | None = None
    """'bf16' or 'fp16' (fp16 with a ``ShardedGradScaler``); None: fp32."""
    tolerance: float | None = None
    """fp32: the largest element difference allowed; mixed precision: the factor over the
    one-process run's distance from exact training. None: 2e-5 / 4."""
    optimizer: str = "sgd"
    """'sgd' (momentum 0.9), 'adamw', or 'muon' (``torch.optim.Muon`` at ``lr`` for the 2-D
    matrices of repeated blocks beside AdamW for the rest: two optimizers, each matrix owned
    whole by one rank). SGD by default: Adam's update is nearly blind to a gradient's scale,
    so a sum where a mean belongs (or a missing part of one) would pass; Muon's, which
    orthogonalises it, more so."""
    lr: float = 0.01
    """The learning rate."""

    @property
    def judged_tolerance(self) -> float:
        if self.tolerance is not None:
            return self.tolerance
        return FP32_TOLERANCE if self.mixed_precision is None else MIXED_PRECISION_FACTOR


def check_config(cfg: VerifyConfig) -> None:
    """Refuse bad settings, and a model that cannot train, before any rank starts."""
    if cfg.level not in LEVELS:
        raise ValueError(f"--level must be one of {', '.join(LEVELS)}, got {cfg.level!r}")
    if cfg.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {cfg.nproc}")
    if cfg.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.tp < 1 or cfg.nproc % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must be at least 1 and divide --nproc {cfg.nproc}")
    if cfg.pp < 1 or cfg.nproc % cfg.pp:
        raise ValueError(f"--pp {cfg.pp} must be at least 1 and divide --nproc {cfg.nproc}")
    if cfg.pp > 1 and cfg.tp > 1:
        raise ValueError("--pp with --tp: models.gpt.gpt_layers has no tensor-parallel layers yet")
    dp = cfg.nproc // cfg.tp // cfg.pp
    if cfg.batch < 1 or cfg.batch % dp:
        raise ValueError(
            f"--batch {cfg.batch} must divide evenly across {dp} ranks"
            + (
                f" (the data-parallel ones: --nproc {cfg.nproc} / --tp {cfg.tp})"
                if cfg.tp > 1
                else ""
            )
        )
    if cfg.optimizer not in OPTIMIZERS and cfg.optimizer not in WHOLE_MODEL_OPTIMIZERS:
        raise ValueError(
            f"--optimizer must be one of {', '.join([*OPTIMIZERS, *WHOLE_MODEL_OPTIMIZERS])}"
        )
    if cfg.pp > 1 and cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"--pp: --optimizer must be one of {', '.join(OPTIMIZERS)}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be positive, got {cfg.lr}")
    if cfg.tolerance is not None and not cfg.tolerance > 0:
        raise ValueError(f"--tolerance must be positive, got {cfg.tolerance}")
    factory = load_factory(cfg.model)
    if cfg.tp > 1:
        if not accepts_layout(factory):
            raise ValueError(
                f"--tp {cfg.tp}: the factory {cfg.model} takes no 'layout' keyword. A factory "
                "for tensor parallelism is called factory(layout=None) for the plain model and "
                "factory(layout=layout) for the tensor-parallel one, built from the same seed "
                "(see zerokit.tools.workload)"
            )
        factory = functools.partial(factory, layout=None)
        if cfg.model is None:
            _check_builtin_tp(cfg.tp)
    work = build_workload(factory, batch=cfg.batch, seq=cfg.seq, per_rank=cfg.batch // dp)
    if cfg.pp > 1:
        check_pipeline_model(work.model, cfg.model or "the built-in GPT")
        m = cfg.micro_batches or cfg.pp
        if m < 1 or (cfg.batch // dp) % m:
            raise ValueError(
                f"--micro-batches {m} must be at least 1 and divide the {cfg.batch // dp} rows "
                "each data-parallel rank runs (--batch / (--nproc / --pp))"
            )
        if cfg.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}")


def _check_builtin_tp(tp: int) -> None:
    heads = 8  # default_model's; its width 256 and vocabulary 2048 split wherever heads do
    if heads % tp:
        raise ValueError(f"--tp {tp}: the built-in GPT's {heads} heads are not divisible by it")


def run_verify(cfg: VerifyConfig, progress: Callable[[str], None] = print) -> dict:
    """Train and compare; the report (``judge`` decides). Raises ValueError on bad settings."""
    check_config(cfg)
    backend = local_backend(cfg.nproc)
    with tempfile.TemporaryDirectory(prefix="zerokit-verify-") as tmp:
        out = os.path.join(tmp, "report.json")
        progress(
            f"training {cfg.steps} steps on {cfg.nproc} {backend} ranks and on one process ..."
        )
        spawn_local(_verify_rank, cfg.nproc, cfg, out, backend=backend)
        ran = json.loads(Path(out).read_text())
    return {
        "model": cfg.model or "built-in GPT",
        "level": cfg.level,
        "nproc": cfg.nproc,
        "tp": cfg.tp,
        "pp": cfg.pp,
        "backend": backend,
        "batch": cfg.batch,
        "precision": cfg.mixed_precision or "fp32",
        "optimizer": f"{cfg.optimizer} lr {cfg.lr:g}"
        + (" (Newton-Schulz in fp32) beside AdamW" if cfg.optimizer == "muon" else ""),
        "tolerance": cfg.judged_tolerance,
        "ddp_factor": DDP_FACTOR,
        "forward": ran["forward"],
        "steps": ran["steps"],
    }


def _verify_rank(rank: int, world_size: int, cfg: VerifyConfig, out: str) -> None:
    if cfg.optimizer == "muon":  # this rank process only: compare sharding, not bf16 rounding
        newton_schulz_in_fp32()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dp = world_size // cfg.tp // cfg.pp
    layout = init_hybrid_parallel(dp, cfg.tp, pp_degree=cfg.pp) if cfg.tp * cfg.pp > 1 else None
    factory = load_factory(cfg.model)
    plain_factory = factory if cfg.tp == 1 else functools.partial(factory, layout=None)
    torch.manual_seed(0)
    plain = build_workload(plain_factory, batch=cfg.batch, seq=cfg.seq, per_rank=cfg.batch // dp)
    plain.model.to(device)
    work = plain
    if cfg.tp > 1:  # the tp model from the same seed: its full parameters are plain's
        torch.manual_seed(0)
        work = tp_workload(factory, layout, plain)
    low = LOW[cfg.mixed_precision]
    per_rank = cfg.batch // dp
    dp_rank = layout.dp_rank if layout is not None else rank
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    forward = _forward_check(plain, cfg, mine, device, rank)  # before anything is wrapped
    exact, same_policy, ddp = _references(plain.model, cfg, low, rank)
    group = layout.dp_group if layout is not None else None  # ZeRO across the replicas
    if cfg.pp > 1:
        optimizer = functools.partial(OPTIMIZERS[cfg.optimizer], lr=cfg.lr)
        pipe = PipelineTrainer(plain.model, plain.loss_fn, layout, optimizer, cfg.level, low, cfg)
    else:
        dist_run = _Trainer(work.model.to(device), cfg, cfg.level, low, group)
    rows = []
    for step in range(cfg.steps):
        x, y = (t.to(device) for t in plain.make_batch(step, cfg.batch))
        if cfg.pp > 1:  # the pipeline's loss is the global batch's mean already
            mean = pipe.step(x[mine], y[mine], step).item()
            full = pipe.full_state()
        else:
            loss = dist_run.step(x[mine], y[mine], work, step)
            # equal slices: the mean of the ranks' means is the batch's (tp groups agree)
            dist.all_reduce(hand(loss))
            mean = loss.item() / world_size
            full = gather_full_state_dict(dist_run.model)  # collective: full fp32 (master)
        if ddp is not None:
            ddp.step(x[mine], y[mine], plain, step)
        if rank == 0:
            ref_loss = exact.step(x, y, plain, step)
            if same_policy is not None:
                ref_loss = same_policy.step(x, y, plain, step)
            row = _compare_step(step, mean, ref_loss.item(), full, exact, same_policy, ddp)
            rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps({"forward": forward, "steps": rows}))


def _references(model, cfg: VerifyConfig, low, rank: int):
    """Rank 0's one-process runs (exact fp32; the same policy, under mixed precision) and every
    rank's DDP yardstick (not with --tp/--pp), each from a copy of the model every rank starts
    from (the wrap broadcasts rank 0's)."""
    one_process = dist.new_group([0])  # every rank takes part in making it
    exact = _Trainer(copy.deepcopy(model), cfg) if rank == 0 else None
    same_policy = None
    if low is not None and rank == 0:
        same_policy = _Trainer(copy.deepcopy(model), cfg, cfg.level, low, one_process)
    ddp = _DDPTrainer(copy.deepcopy(model), cfg, low) if cfg.tp * cfg.pp == 1 else None
    return exact, same_policy, ddp


def _forward_check(plain: Workload, cfg: VerifyConfig, mine: slice, device, rank: int):
    """The first batch's fp32 loss: the ranks' mean over their slices beside one process's on
    the whole batch (rank 0's dict; None elsewhere), from the same parameters and seed."""
    x, y = (t.to(device) for t in plain.make_batch(0, cfg.batch))
    with torch.no_grad():
        torch.manual_seed(1000)
        mine_loss = plain.loss_fn(plain.model(x[mine]), y[mine]).detach().double()
        dist.all_reduce(hand(mine_loss))  # every rank's slice (tp ranks alike: the same mean)
        if rank != 0:
            return None
        torch.manual_seed(1000)
        whole = plain.loss_fn(plain.model(x), y).item()
    return {"ranks": mine_loss.item() / dist.get_world_size(), "one_process": whole}


def _optimizers_for(model, cfg: VerifyConfig):
    """``--optimizer``'s optimizer over ``model``, or its list (Muon beside AdamW)."""
    if cfg.optimizer in WHOLE_MODEL_OPTIMIZERS:
        return WHOLE_MODEL_OPTIMIZERS[cfg.optimizer](model, lr=cfg.lr)
    return OPTIMIZERS[cfg.optimizer](model.parameters(), cfg.lr)


class _Trainer:
    """One model and its optimizer: plain (no level) or wrapped at ``level`` over ``group``."""

    def __init__(self, model, cfg: VerifyConfig, level=None, low=None, group=None):
        self.optimizer = _optimizers_for(model, cfg)
        self.scaler = None
        if level is not None:
            scaler = ShardedGradScaler() if low == torch.float16 else None
            model, self.optimizer, self.scaler = group_sharded_parallel(
                model,
                self.optimizer,
                level,
                scaler=scaler,
                group=group,
                mixed_precision=MixedPrecision(param_dtype=low),
            )
        self.model = model

    def step(self, x, y, work: Workload, step: int) -> torch.Tensor:
        torch.manual_seed(1000 + step)  # the same random stream on every rank and here
        loss = work.loss_fn(self.model(x), y)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        step_and_zero(self.optimizer, self.scaler)
        return loss.detach().double()


class _DDPTrainer:
    """The yardstick: the same model and optimizer on every rank, each gradient averaged over
    the ranks after backward as torch's DDP does, in plain torch (no buckets, no buffer
    broadcast, unused parameters allowed); mixed precision under ``torch.autocast``, fp16 with
    torch's ``GradScaler``."""

    def __init__(self, model, cfg: VerifyConfig, low):
        self.model = model
        self.optimizer = _optimizers_for(model, cfg)
        self.low = low
        fp16 = low == torch.float16
        self.scaler = torch.amp.GradScaler(model_device(model).type) if fp16 else None

    def step(self, x, y, work: Workload, step: int) -> None:
        torch.manual_seed(1000 + step)
        with torch.autocast(x.device.type, dtype=self.low, enabled=self.low is not None):
            output = self.model(x)
        loss = work.loss_fn(output, y)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        self._average_grads()
        step_and_zero(self.optimizer, self.scaler)

    def _average_grads(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # a parameter this rank did not use: zeros, as DDP's
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(hand(flat))
        flat /= dist.get_world_size()
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))


def model_device(model) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _compare_step(step, loss, ref_loss, full, exact, same_policy, ddp) -> dict:
    """Per parameter tensor: fp32, max |distributed - one process| (and DDP's); mixed
    precision, the squared distances from exact training of the distributed run, the
    one-process run (and DDP)."""
    same = dict(same_policy.model.state_dict()) if same_policy is not None else None
    theirs = dict(ddp.model.named_parameters()) if ddp is not None else {}
    tensors = {}
    for name, want in exact.model.named_parameters():
        want = want.detach().double()
        got = full[name].detach().double()
        entry = _distance(got, want, same is None)
        if name in theirs:
            ddp_entry = _distance(theirs[name].detach().double(), want, same is None)
            entry.update({k + "_ddp": v for k, v in ddp_entry.items()})
        if same is not None:
            entry["sq_one_process"] = _distance(same[name].detach().double(), want, False)["sq"]
        tensors[name] = entry
    return {"step": step + 1, "loss": loss, "loss_one_process": ref_loss, "tensors": tensors}


def _distance(got: torch.Tensor, want: torch.Tensor, fp32: bool) -> dict:
    if fp32:
        return {"max_abs": (got - want).abs().max().item() if got.numel() else 0.0}
    return {"numel": got.numel(), "sq": ((got - want) ** 2).sum().item()}


# -- judging ----------------------------------------------------------------------------------
def judge(report: dict) -> dict:
    """The verdict: per step the figure judged, its worst tensor, DDP's figure and the bound
    allowed; the first step beyond the bound with the tensor that diverged most; the figure
    after the last step; whether the forward itself computes alike on slices.

    fp32: the largest element difference of any tensor. Mixed precision: the RMS distance of
    every master element from exact training, over the one-process run's (a ratio; per tensor
    it is too noisy to judge: one Adam step can leave a tensor of the one-process run exact),
    and the worst tensor is the one adding the most squared distance beyond that run's. The
    bound is the tolerance, or ``ddp_factor`` times DDP's figure when DDP ran and the forward
    computes alike on slices (a forward that does not makes DDP diverge as well).
    """
    mixed = report["precision"] != "fp32"
    forward_alike = _forward_alike(report.get("forward"))
    factor = report.get("ddp_factor", DDP_FACTOR) if forward_alike else None
    per_step, first_bad = [], None
    for row in report["steps"]:
        tensors = row["tensors"]
        value, worst, ddp = _rms_figures(tensors) if mixed else _max_figures(tensors)
        bound = report["tolerance"]
        if ddp is not None and factor is not None:
            bound = max(bound, factor * ddp)
        per_step.append({"step": row["step"], "tensor": worst, "value": value, "ddp": ddp,
                         "bound": bound})  # fmt: skip
        if not value <= bound and first_bad is None:  # NaN is beyond too
            first_bad = per_step[-1]
    return {
        "passed": first_bad is None,
        "per_step": per_step,
        "worst": per_step[-1],
        "first_beyond": first_bad,
        "forward_alike": forward_alike,
    }


def _forward_alike(forward: dict | None) -> bool:
    if forward is None:  # not checked (a hand-made report)
        return True
    one = forward["one_process"]
    return abs(forward["ranks"] - one) <= FORWARD_TOLERANCE * max(1.0, abs(one))


def _max_figures(tensors: dict) -> tuple[float, str, float | None]:
    worst = max(tensors, key=lambda n: tensors[n]["max_abs"])
    ddp = [t["max_abs_ddp"] for t in tensors.values() if "max_abs_ddp" in t]
    return tensors[worst]["max_abs"], worst, max(ddp) if ddp else None


def _rms_figures(tensors: dict) -> tuple[float, str, float | None]:
    worst = max(tensors, key=lambda n: tensors[n]["sq"] - tensors[n]["sq_one_process"])
    entries = list(tensors.values())
    ddp = None
    if all("sq_ddp" in e for e in entries):
        ddp = _rms_ratio([{**e, "sq": e["sq_ddp"]} for e in entries])
    return _rms_ratio(entries), worst, ddp


def _rms_ratio(entries) -> float:
    entries = list(entries)
    numel = max(1, sum(e["numel"] for e in entries))
    distributed = math.sqrt(sum(e["sq"] for e in entries) / numel)
    one_process = math.sqrt(sum(e["sq_one_process"] for e in entries) / numel)
    return distributed / max(one_process, _RMS_FLOOR)


def _tp(report: dict) -> str:
    tp, pp = report.get("tp", 1), report.get("pp", 1)
    if pp > 1:
        return f" (pp {pp} x dp {report['nproc'] // pp})"
    return f" (tp {tp} x dp {report['nproc'] // tp})" if tp > 1 else ""


def format_report(report: dict, verdict: dict) -> str:
    """The per-step table and the verdict, as ``zerokit verify`` prints them."""
    mixed = report["precision"] != "fp32"
    n = report["nproc"]
    shown = (lambda v: "-" if v is None else f"{v:.2f}x") if mixed else (
        lambda v: "-" if v is None else f"{v:.1e}")  # fmt: skip
    lines = [
        f"{report['model']}: level '{report['level']}' on {n} {report['backend']} ranks"
        f"{_tp(report)} against one process, global batch {report['batch']}, "
        f"{report['precision']}, {report['optimizer']}",
        f"{'step':>4}  {'loss (1 process)':>16}  {'loss (' + str(n) + ' ranks)':>15}  "
        f"{'loss diff':>9}  {'param diff':>10}  {'DDP diff':>8}  {'allowed':>8}  worst tensor",
    ]
    for row, judged in zip(report["steps"], verdict["per_step"]):
        diff = abs(row["loss"] - row["loss_one_process"])
        lines.append(
            f"{judged['step']:>4}  {row['loss_one_process']:>16.6f}  {row['loss']:>15.6f}  "
            f"{diff:>9.1e}  {shown(judged['value']):>10}  {shown(judged['ddp']):>8}  "
            f"{shown(judged['bound']):>8}  {judged['tensor']}"
        )
    lines += _verdict_lines(report, verdict, shown)
    return "\n".join(lines)


def _what(report: dict) -> str:
    if report["precision"] == "fp32":
        return "max |element difference| from one process"
    return (
        "RMS distance of all parameters from exact fp32 training, over the one-process "
        f"{report['precision']} run's"
    )


def _verdict_lines(report: dict, verdict: dict, shown) -> list[str]:
    mixed = report["precision"] != "fp32"
    tol = f"{report['tolerance']:g}x" if mixed else f"{report['tolerance']:g}"
    factor = report.get("ddp_factor", DDP_FACTOR)
    last = verdict["worst"]
    if last["ddp"] is None:
        ddp, allowed = "no DDP yardstick with --tp/--pp", f"tolerance {tol}"
    elif not verdict["forward_alike"]:
        ddp = f"DDP on the same ranks {shown(last['ddp'])}"
        allowed = f"tolerance {tol}: DDP is no yardstick, the forward differs on slices"
    else:
        ddp, allowed = (
            f"DDP on the same ranks {shown(last['ddp'])}",
            f"tolerance {tol} or {factor:g}x DDP's",
        )
    lines = [
        f"after step {last['step']}: zerokit {shown(last['value'])}, worst in {last['tensor']}; "
        f"{ddp} ({_what(report)}; allowed: {allowed})"
    ]
    level, n = report["level"], report["nproc"]
    first = verdict["first_beyond"]
    if first is None:
        lines.append(f"PASS: {n} ranks{_tp(report)} at '{level}' train as one process does")
        return lines
    where = (
        f"{first['tensor']} diverged first, at step {first['step']} (zerokit "
        f"{shown(first['value'])}, DDP {shown(first['ddp'])}, allowed {shown(first['bound'])})"
    )
    if not verdict["forward_alike"]:
        fwd = report["forward"]
        lines.append(
            f"FAIL: {where}. The model's forward computes differently on the ranks' slices: "
            f"the first batch's loss before any update is {fwd['ranks']:.6f} on {n} ranks and "
            f"{fwd['one_process']:.6f} on one process, so any data parallelism diverges too. A forward "
            "that "
            "reads the rank, or draws random numbers per row (dropout; Hugging Face GPT-2 "
            "configs default to 0.1), differs on slices of the batch from one process on all of it."
        )
    elif first["ddp"] is not None:
        lines.append(
            f"FAIL: {where}. DDP on the same ranks stays within it and the model's forward "
            "computes alike on slices: zerokit diverged where DDP did not (report it, with "
            "this command)."
        )
    else:
        lines.append(f"FAIL: {where}; the model's forward computes alike on slices.")
    return lines
