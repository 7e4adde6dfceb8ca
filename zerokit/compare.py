"""``zerokit compare``: train one model under torch DDP and every zerokit level, and print per
level the measured and estimated bytes per rank, the peak, the step time and the final loss.

The model contract (``--model pkg.module:factory``): ``factory()`` returns an ``nn.Module``
whose forward maps token ids ``[batch, seq]`` (int64) to logits ``[batch, seq, vocab]``; the
vocabulary size is read from one probe forward. Training data is a learnable synthetic token
stream; every rank trains on its slice of the global batch, so the final loss must be equal
across levels (a visible check of equivalence).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .api import group_sharded_parallel
from .launch import spawn_local
from .memory import PeakMemory, estimate, format_bytes, measure
from .mixed_precision import MixedPrecision
from .models.gpt import lm_loss, synthetic_batch
from .scaler import ShardedGradScaler

LEVELS = ("ddp", "os", "os_g", "p_g_os")


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    model: str | None = None
    """``pkg.module:factory`` returning the model; None: the built-in small GPT."""
    nproc: int = 2
    """Ranks to start (ignored under torchrun, which decides)."""
    steps: int = 16
    """Training steps per level."""
    batch: int = 8
    """Global batch (sequences); split evenly across ranks."""
    seq: int = 32
    """Tokens per sequence."""
    mixed_precision: str | None = None
    """'bf16' or 'fp16': zerokit levels compute in it with fp32 master shards (fp16 with a
    ``ShardedGradScaler``); DDP runs under ``torch.autocast`` with fp32 parameters."""


def load_factory(spec: str | None):
    """The model factory named by ``pkg.module:factory`` (the built-in GPT if None)."""
    if spec is None:
        return default_model
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like pkg.module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model: cannot import {module_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model: {module_name!r} has no callable {attr!r}")
    return factory


def default_model() -> nn.Module:
    from .models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=2048, block_size=64, n_layer=6, n_head=8, n_embd=256))


def build_model(factory) -> nn.Module:
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def probe_vocab(model: nn.Module, seq: int) -> int:
    """The vocabulary size, from one forward of token ids [1, seq]; a clear error otherwise."""
    try:
        with torch.no_grad():
            logits = model(torch.zeros(1, seq, dtype=torch.long))
    except Exception as e:
        raise ValueError(f"--model: forward of token ids [1, {seq}] failed: {e}") from e
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != (1, seq):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"--model: forward must return logits [1, {seq}, vocab], got {shape}")
    return logits.shape[-1]


def _train_level(rank: int, world_size: int, level: str, cfg: CompareConfig, out_dir: str) -> None:
    """Build, wrap and train the model under ``level`` on this rank; rank 0 writes the row."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    peak = PeakMemory(device)
    peak.start()  # before the model exists: its state counts toward the peak
    torch.manual_seed(0)
    model = build_model(load_factory(cfg.model))
    vocab = probe_vocab(model, cfg.seq)
    model.to(device)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[cfg.mixed_precision]
    policy = MixedPrecision(param_dtype=low) if level != "ddp" else MixedPrecision()
    estimated = estimate(
        model, "dp" if level == "ddp" else level, world_size, mixed_precision=policy
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = None
    if level == "ddp":
        device_ids = [device.index] if cuda else None
        model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        if low == torch.float16:
            scaler = torch.amp.GradScaler(device.type)
    else:
        scaler = ShardedGradScaler() if low == torch.float16 else None
        model, optimizer, scaler = group_sharded_parallel(
            model, optimizer, level, scaler=scaler, mixed_precision=policy
        )
    autocast = torch.autocast(device.type, dtype=low, enabled=level == "ddp" and low is not None)
    per_rank = cfg.batch // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    times, measured, loss = [], None, torch.zeros(())
    for step in range(cfg.steps):
        x, y = (t.to(device) for t in synthetic_batch(vocab, cfg.batch, cfg.seq, seed=step))
        start = time.perf_counter()
        with autocast:
            logits = model(x[mine])
        loss = lm_loss(logits.float(), y[mine])
        (scaler.scale(loss) if scaler else loss).backward()
        if step == cfg.steps - 1:  # what a rank holds with gradients present
            measured = measure(model, optimizer)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    values = torch.tensor(
        [measured.params, measured.grads, measured.optimizer, peak.read()], dtype=torch.float64
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)  # the largest over ranks
    final = loss.detach().double().clone()
    dist.all_reduce(final)
    if rank == 0:
        params, grads, opt_bytes, peak_bytes = (int(v) for v in values.tolist())
        row = {
            "level": level,
            "measured": {
                "params": params,
                "grads": grads,
                "optimizer": opt_bytes,
                "peak": peak_bytes,
            },
            "estimated": {**asdict(estimated), "total": estimated.total},
            "step_time_s": statistics.median(times[1:] or times),
            "final_loss": final.item() / world_size,
        }
        Path(out_dir, f"{level}.json").write_text(json.dumps(row))


def run_compare(cfg: CompareConfig, progress=print) -> dict:
    """Run every level (fresh ranks for each, so peaks don't mix) and return the report.

    CPU/gloo by default; CUDA/NCCL, one GPU per rank, when there are ``nproc`` GPUs.
    """
    if cfg.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {cfg.nproc}")
    if cfg.batch % cfg.nproc:
        raise ValueError(f"--batch {cfg.batch} must divide evenly across --nproc {cfg.nproc} ranks")
    probe_vocab(build_model(load_factory(cfg.model)), cfg.seq)  # fail here, not in the ranks
    backend = (
        "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.nproc else "gloo"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="zerokit-compare-") as out_dir:
        for i, level in enumerate(LEVELS, 1):
            started = time.perf_counter()
            progress(
                f"[{i}/{len(LEVELS)}] {level:<7} training {cfg.steps} steps on {cfg.nproc} "
                f"{backend} ranks ..."
            )
            spawn_local(_train_level, cfg.nproc, level, cfg, out_dir, backend=backend)
            rows.append(json.loads(Path(out_dir, f"{level}.json").read_text()))
            progress(f"      {level:<7} done in {time.perf_counter() - started:.1f} s")
    return {"world_size": cfg.nproc, "backend": backend, "rows": rows}


def format_table(report: dict) -> str:
    """The report as a fixed-width table: measured / estimated bytes per rank."""
    head = f"{'level':<8}{'params':>22}{'grads':>22}{'optimizer':>22}{'total':>22}{'peak':>12}{'step s':>9}{'final loss':>12}"
    lines = [
        f"bytes per rank (largest over {report['world_size']} ranks), measured / estimated",
        head,
    ]
    for row in report["rows"]:
        m, e = row["measured"], row["estimated"]
        total = m["params"] + m["grads"] + m["optimizer"]
        cells = [
            f"{format_bytes(m[k])} / {format_bytes(e[k])}" for k in ("params", "grads", "optimizer")
        ] + [f"{format_bytes(total)} / {format_bytes(e['total'])}"]
        lines.append(
            f"{row['level']:<8}"
            + "".join(f"{c:>22}" for c in cells)
            + f"{format_bytes(m['peak']):>12}{row['step_time_s']:>9.3f}{row['final_loss']:>12.6f}"
        )
    if report.get("backend") == "nccl":
        lines.append("peak: torch's CUDA allocator peak while building and training.")
    else:
        lines.append(
            "peak: the most resident memory a rank used while building and training, above what "
            "it held before (the kernel's VmHWM on CPU)."
        )
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    """A stacked bar chart of measured bytes by category per level."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    levels = [row["level"] for row in report["rows"]]
    bottom = [0.0] * len(levels)
    fig, ax = plt.subplots(figsize=(7, 4))
    for category in ("params", "grads", "optimizer"):
        mib = [row["measured"][category] / 2**20 for row in report["rows"]]
        ax.bar(levels, mib, bottom=bottom, label=category)
        bottom = [b + v for b, v in zip(bottom, mib)]
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Model state per rank by level ({report['world_size']} ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main_under_torchrun(cfg: CompareConfig) -> dict:
    """Under torchrun the ranks exist already: run the levels one after another in them."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.replace(cfg, nproc=world_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zerokit-compare-") as out_dir:  # rank 0 writes
        for level in LEVELS:
            _train_level(rank, world_size, level, cfg, out_dir)
            if rank == 0:
                rows.append(json.loads(Path(out_dir, f"{level}.json").read_text()))
    report = {"world_size": world_size, "backend": dist.get_backend(), "rows": rows}
    return report if rank == 0 else {}


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
