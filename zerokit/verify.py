"""``zerokit verify``: the equivalence principle as a command.

Trains the model (``zerokit.workload``'s contract) on ``nproc`` ranks at a level, each rank on
its slice of the global batch, and beside it, on rank 0, the same model on one process on the
whole global batch; after every step the full parameters of both are compared.

What is judged after every step:

- fp32: the largest ``|distributed - one process|`` element of any parameter, against
  ``tolerance`` (default 2e-5: averaging N slices' gradients rounds differently from one
  gradient of the batch).
- mixed precision: two low-precision runs rounded differently drift apart, so neither is the
  other's reference. Both are measured against exact fp32 training of the same model on one
  process: the distributed run's RMS distance from it, over all parameter elements, must stay
  within ``tolerance`` times (default 4) that of the same policy on one process (zerokit at
  one rank), as tests/test_mixed_precision.py judges.

Every forward runs after ``torch.manual_seed(1000 + step)`` on every rank and in the reference,
so a model that draws random numbers per row (dropout), or whose forward reads the rank, draws
or computes differently on the ranks than one process does on the batch: it fails, with the
tensor that diverged first named.
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

from .api import LEVELS, group_sharded_parallel
from .core.teardown import hand
from .launch import local_backend, spawn_local
from .layout import init_hybrid_parallel
from .mixed_precision import MixedPrecision
from .pipeline.schedules import SCHEDULES
from .plan_optimizers import muon_and_adamw, newton_schulz_in_fp32
from .scaler import ShardedGradScaler, step_and_zero
from .tensor_parallel import gather_full_state_dict
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
OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
}
# built from the model (``zerokit.plan_optimizers``): Muon for the blocks' matrices, AdamW else
WHOLE_MODEL_OPTIMIZERS = {"muon": muon_and_adamw}
LOW = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
_RMS_FLOOR = 1e-9  # a one-process run that stayed exact: the distributed one must nearly too


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    level: str
    """'os', 'os_g' or 'p_g_os'."""
    model: str | None = None
    """``pkg.module:factory`` (``zerokit.workload``); None: the built-in small GPT."""
    nproc: int = 2
    """Ranks to start."""
    tp: int = 1
    """Tensor-parallel degree: ``nproc // tp`` data-parallel replicas of ``tp`` ranks, ZeRO
    over each tp rank's dp group (``zerokit.workload``: the factory takes ``layout``)."""
    pp: int = 1
    """Pipeline stages (``zerokit.verify_pp``): the model, a ``zerokit.models.gpt.GPT``, as a
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
                "(see zerokit.workload)"
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
        steps = json.loads(Path(out).read_text())
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
        "steps": steps,
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
    work = plain
    if cfg.tp > 1:  # the tp model from the same seed: its full parameters are plain's
        torch.manual_seed(0)
        work = tp_workload(factory, layout, plain)
    low = LOW[cfg.mixed_precision]
    one_process = dist.new_group([0])  # every rank takes part in making it
    # rank 0's references start from the model every rank starts from (the wrap broadcasts it)
    exact = _Trainer(copy.deepcopy(plain.model).to(device), cfg) if rank == 0 else None
    same_policy = None
    if low is not None and rank == 0:
        start = copy.deepcopy(plain.model).to(device)
        same_policy = _Trainer(start, cfg, cfg.level, low, one_process)
    group = layout.dp_group if layout is not None else None  # ZeRO across the replicas
    if cfg.pp > 1:
        optimizer = functools.partial(OPTIMIZERS[cfg.optimizer], lr=cfg.lr)
        pipe = PipelineTrainer(
            plain.model.to(device), plain.loss_fn, layout, optimizer, cfg.level, low, cfg
        )
    else:
        dist_run = _Trainer(work.model.to(device), cfg, cfg.level, low, group)
    per_rank = cfg.batch // dp
    dp_rank = layout.dp_rank if layout is not None else rank
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
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
        if rank == 0:
            ref_loss = exact.step(x, y, plain, step)
            if same_policy is not None:
                ref_loss = same_policy.step(x, y, plain, step)
            rows.append(_compare_step(step, mean, ref_loss.item(), full, exact, same_policy))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


class _Trainer:
    """One model and its optimizer: plain (no level) or wrapped at ``level`` over ``group``."""

    def __init__(self, model, cfg: VerifyConfig, level=None, low=None, group=None):
        if cfg.optimizer in WHOLE_MODEL_OPTIMIZERS:  # a list (Muon beside AdamW)
            self.optimizer = WHOLE_MODEL_OPTIMIZERS[cfg.optimizer](model, lr=cfg.lr)
        else:
            self.optimizer = OPTIMIZERS[cfg.optimizer](model.parameters(), cfg.lr)
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


def _compare_step(step, loss, ref_loss, full, exact, same_policy) -> dict:
    """Per parameter tensor: fp32, max |distributed - one process|; mixed precision, the RMS
    distances from exact training of the distributed and the one-process run."""
    same = dict(same_policy.model.state_dict()) if same_policy is not None else None
    tensors = {}
    for name, want in exact.model.named_parameters():
        got = full[name].detach().double()
        want = want.detach().double()
        if same is None:
            tensors[name] = {"max_abs": (got - want).abs().max().item() if got.numel() else 0.0}
        else:  # squared distances from exact training, summed (a ratio of RMS is judged)
            tensors[name] = {
                "numel": got.numel(),
                "sq": ((got - want) ** 2).sum().item(),
                "sq_one_process": ((same[name].detach().double() - want) ** 2).sum().item(),
            }
    return {"step": step + 1, "loss": loss, "loss_one_process": ref_loss, "tensors": tensors}


# -- judging ----------------------------------------------------------------------------------
def judge(report: dict) -> dict:
    """The verdict: per step the figure judged and its worst tensor; the first step beyond the
    tolerance with the tensor that diverged most; the figure after the last step.

    fp32: the largest element difference of any tensor. Mixed precision: the RMS distance of
    every master element from exact training, over the one-process run's (a ratio; per tensor
    it is too noisy to judge: one Adam step can leave a tensor of the one-process run exact),
    and the worst tensor is the one adding the most squared distance beyond that run's.
    """
    mixed = report["precision"] != "fp32"
    tol = report["tolerance"]
    per_step, first_bad = [], None
    for row in report["steps"]:
        tensors = row["tensors"]
        if mixed:
            value = _rms_ratio(tensors.values())
            worst = max(tensors, key=lambda n: tensors[n]["sq"] - tensors[n]["sq_one_process"])
        else:
            worst = max(tensors, key=lambda n: tensors[n]["max_abs"])
            value = tensors[worst]["max_abs"]
        per_step.append((row["step"], worst, value))
        if not value <= tol and first_bad is None:  # NaN is beyond too
            first_bad = {"step": row["step"], "tensor": worst, "value": value}
    _, worst, value = per_step[-1]
    return {
        "passed": first_bad is None,
        "per_step": per_step,
        "worst": {"tensor": worst, "value": value},
        "first_beyond": first_bad,
    }


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
    n, level, tol = report["nproc"], report["level"], report["tolerance"]
    what = (
        f"RMS distance of all parameters from exact fp32 training, over the one-process "
        f"{report['precision']} run's"
        if mixed
        else "max |element difference|"
    )
    lines = [
        f"{report['model']}: level '{level}' on {n} {report['backend']} ranks{_tp(report)} "
        f"against one process, global batch {report['batch']}, {report['precision']}, {report['optimizer']}",
        f"{'step':>4}  {'loss (1 process)':>16}  {'loss (' + str(n) + ' ranks)':>15}  "
        f"{'loss diff':>9}  {'param diff':>10}  worst tensor",
    ]
    for row, (step, worst, value) in zip(report["steps"], verdict["per_step"]):
        diff = abs(row["loss"] - row["loss_one_process"])
        shown = f"{value:.2f}x" if mixed else f"{value:.1e}"
        lines.append(
            f"{step:>4}  {row['loss_one_process']:>16.6f}  {row['loss']:>15.6f}  {diff:>9.1e}  "
            f"{shown:>10}  {worst}"
        )
    worst = verdict["worst"]
    value = f"{worst['value']:.2f}x" if mixed else f"{worst['value']:.2e}"
    limit = f"{tol:g}x" if mixed else f"{tol:g}"
    where = "largest beyond the one-process run's in" if mixed else "in"
    lines.append(
        f"largest parameter difference after step {report['steps'][-1]['step']}: {value}, "
        f"{where} {worst['tensor']} ({what}; tolerance {limit})"
    )
    first = verdict["first_beyond"]
    if first is None:
        lines.append(f"PASS: {n} ranks{_tp(report)} at '{level}' train as one process does")
    else:
        value = f"{first['value']:.2f}x" if mixed else f"{first['value']:.2e}"
        lines.append(
            f"FAIL: {first['tensor']} diverged first, at step {first['step']} ({value}, tolerance "
            f"{limit}). A forward that reads the rank, or draws random numbers per row "
            "(dropout), differs on slices of the batch from one process on all of it."
        )
    return "\n".join(lines)
