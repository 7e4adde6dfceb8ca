"""``zerokit compare``: train one model under torch DDP and every zerokit level, and print per
level the measured and estimated bytes per rank, the peak, the step time and the final loss.

The model contract (``--model pkg.module:factory``) is ``zerokit.tools.workload``'s.

Every rank trains on its slice of the global batch, so the final loss must be equal across
levels (a visible check of equivalence). Each level runs in fresh processes, under torchrun
too, so one level's memory never inflates or hides another's peak.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from ..api import group_sharded_parallel
from ..layout import init_hybrid_parallel
from ..memory import (
    ESTIMATE_LEVELS,
    PeakMemory,
    estimate,
    estimate_activations,
    measure,
    measure_activations,
)
from ..mixed_precision import PRECISIONS, MixedPrecision
from ..runtime.teardown import hand
from ..scaler import ShardedGradScaler, step_and_zero
from .launch import local_backend, spawn_local
from .workload import (  # noqa: F401  (the contract, importable from here as before)
    Workload,
    build_workload,
    default_loss,
    default_model,
    load_factory,
)

LEVELS = ESTIMATE_LEVELS  # DDP beside every level, as estimate() takes them
PRECISION = {None: "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    model: str | None = None
    """``pkg.module:factory`` returning the model (see the module docstring); None: the
    built-in small GPT."""
    nproc: int = 2
    """Ranks to start (ignored under torchrun, which decides)."""
    steps: int = 16
    """Training steps per level."""
    batch: int = 8
    """Global batch (sequences, or rows of ``make_batch``); split evenly across ranks."""
    seq: int = 32
    """Tokens per sequence (token models only)."""
    mixed_precision: str | None = None
    """'bf16' or 'fp16': zerokit levels compute in it with fp32 master shards (fp16 with a
    ``ShardedGradScaler``); DDP runs under ``torch.autocast`` with fp32 parameters."""
    sharding_degree: int = 1
    """Hybrid sharding: the zerokit levels shard over groups of this many ranks and replicate
    across ``nproc / sharding_degree`` of them (``init_hybrid_parallel``); 1: across all."""


def _train_level(rank: int, world_size: int, level: str, cfg: CompareConfig, out_dir: str) -> None:
    """Build, wrap and train the model under ``level`` on this rank; rank 0 writes the row."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    peak = PeakMemory(device)
    peak.start()  # before the model exists: its state counts toward the peak
    torch.manual_seed(0)
    per_rank = cfg.batch // world_size
    work = build_workload(load_factory(cfg.model), batch=cfg.batch, seq=cfg.seq, per_rank=per_rank)
    model = work.model.to(device)
    low = {None: None, **PRECISIONS}[cfg.mixed_precision]
    policy = MixedPrecision(param_dtype=low) if level != "ddp" else MixedPrecision()
    shards = cfg.sharding_degree
    estimated = estimate(
        model,
        level,
        world_size,
        mixed_precision=policy,
        sharding_degree=shards if level != "ddp" and shards > 1 else None,
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
        groups = {}
        if shards > 1:  # shard inside groups of `shards` ranks, replicate across them
            layout = init_hybrid_parallel(world_size // shards, 1, sharding_degree=shards)
            groups = {"group": layout.sharding_group, "dp_group": layout.dp_group}
        model, optimizer, scaler = group_sharded_parallel(
            model, optimizer, level, scaler=scaler, mixed_precision=policy, **groups
        )
    autocast = torch.autocast(device.type, dtype=low, enabled=level == "ddp" and low is not None)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    times, measured, loss = [], None, torch.zeros(())
    for step in range(cfg.steps):
        x, y = (t[mine].to(device) for t in work.make_batch(step, cfg.batch))
        start = time.perf_counter()
        with autocast:
            output = model(x)
        loss = work.loss_fn(output, y)
        (scaler.scale(loss) if scaler else loss).backward()
        if step == cfg.steps - 1:  # what a rank holds with gradients present
            measured = measure(model, optimizer)
        step_and_zero(optimizer, scaler)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    values = torch.tensor(
        [measured.params, measured.grads, measured.optimizer, peak.read()],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(hand(values), op=dist.ReduceOp.MAX)  # the largest over ranks
    final = loss.detach().double().clone()
    dist.all_reduce(hand(final))
    if rank == 0:
        params, grads, opt_bytes, peak_bytes = (int(v) for v in values.tolist())
        row = {
            "level": level,
            "measured": {
                "params": params,
                "grads": grads,
                "optimizer": opt_bytes,
                "total": params + grads + opt_bytes,
                "peak": peak_bytes,
            },
            "estimated": {**asdict(estimated), "total": estimated.total},
            "step_time_s": statistics.median(times[1:] or times),
            "final_loss": final.item() / world_size,
        }
        Path(out_dir, f"{level}.json").write_text(json.dumps(row))


def check_config(cfg: CompareConfig) -> None:
    """Refuse bad settings, and a model that cannot train, before any rank starts."""
    if cfg.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {cfg.nproc}")
    if cfg.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.batch % cfg.nproc:
        raise ValueError(f"--batch {cfg.batch} must divide evenly across {cfg.nproc} ranks")
    if cfg.sharding_degree < 1 or cfg.nproc % cfg.sharding_degree:
        raise ValueError(
            f"--sharding-degree {cfg.sharding_degree} must be at least 1 and divide --nproc "
            f"{cfg.nproc}"
        )
    build_workload(
        load_factory(cfg.model), batch=cfg.batch, seq=cfg.seq, per_rank=cfg.batch // cfg.nproc
    )


def _report(cfg: CompareConfig, backend: str, rows: list[dict]) -> dict:
    return {
        "world_size": cfg.nproc,
        "sharding_degree": cfg.sharding_degree,
        "backend": backend,
        "model": cfg.model or "built-in GPT",
        "precision": PRECISION[cfg.mixed_precision],
        "steps": cfg.steps,
        "batch": cfg.batch,
        "rows": rows,
    }


def run_compare(cfg: CompareConfig, progress: Callable[[str], None] = print) -> dict:
    """Run every level (fresh ranks for each, so peaks don't mix) and return the report.

    CPU/gloo by default; CUDA/NCCL, one GPU per rank, when there are ``nproc`` GPUs.
    """
    check_config(cfg)
    backend = local_backend(cfg.nproc)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zerokit-compare-") as out_dir:
        for i, level in enumerate(LEVELS, 1):
            started = _progress_start(progress, i, level, cfg, backend)
            spawn_local(_train_level, cfg.nproc, level, cfg, out_dir, backend=backend)
            rows.append(json.loads(Path(out_dir, f"{level}.json").read_text()))
            progress(f"      {level:<7} done in {time.perf_counter() - started:.1f} s")
    return _report(cfg, backend, rows)


def _progress_start(progress, i: int, level: str, cfg: CompareConfig, backend: str) -> float:
    progress(
        f"[{i}/{len(LEVELS)}] {level:<7} training {cfg.steps} steps on {cfg.nproc} {backend} "
        "ranks ..."
    )
    return time.perf_counter()


def run_under_torchrun(cfg: CompareConfig, progress: Callable[[str], None] = print) -> dict:
    """Under torchrun: every torchrun rank starts one fresh process per level, and those
    processes form that level's process group, so each level's peak is measured from a clean
    process exactly as with ``--nproc``. Returns the report on rank 0, {} elsewhere.

    Note: running the levels one after another in the torchrun processes themselves would
    under-report every peak after the first: memory a finished level freed stays resident (the
    allocator keeps it), so the next level reuses it without raising the high-water mark.
    """
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")  # only to agree on where the children meet
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.replace(cfg, nproc=world_size)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = None
    if rank == 0:  # a fresh port, held for the whole run (no race for it)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    rows = []
    try:
        check_config(cfg)  # every rank: a bad model fails here, on all of them alike
        with tempfile.TemporaryDirectory(prefix="zerokit-compare-") as out_dir:  # rank 0 writes
            for i, level in enumerate(LEVELS, 1):
                started = _progress_start(progress, i, level, cfg, backend) if rank == 0 else 0
                child = mp.get_context("spawn").Process(
                    target=_level_process,
                    args=(rank, world_size, level, cfg, out_dir, host, port[0], backend),
                )
                child.start()
                child.join()
                if child.exitcode != 0:
                    raise RuntimeError(
                        f"level {level}: rank {rank}'s process exited with code {child.exitcode}"
                    )
                if rank == 0:
                    rows.append(json.loads(Path(out_dir, f"{level}.json").read_text()))
                    progress(f"      {level:<7} done in {time.perf_counter() - started:.1f} s")
        dist.barrier()  # rank 0's store serves until every rank is done
    finally:
        if own_group:
            dist.destroy_process_group()
    return _report(cfg, backend, rows) if rank == 0 else {}


def _level_process(rank, world_size, level, cfg, out_dir, host, port, backend) -> None:
    """One rank of one level, in a fresh process started by a torchrun rank."""
    _exit_with_parent()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = dist.PrefixStore(f"zerokit-compare/{level}", dist.TCPStore(host, port))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        _train_level(rank, world_size, level, cfg, out_dir)
    finally:
        dist.destroy_process_group()
    # as in launch.spawn_local: torch 2.13's gloo teardown can abort a finished process
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent() -> None:
    """If the torchrun rank that started this process dies, end this one too (Linux)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# -- zerokit compare --activations ------------------------------------------------------------
#: the five settings of the design documents (Korthikanti et al., Table 2), as GPT options;
#: the estimate's options follow from them (``activation_estimate_options``)
ACTIVATION_SETTINGS = {
    "none": {},
    "tp": {"tensor_parallel": True},
    "tp+sp": {"tensor_parallel": True, "sequence_parallel": True},
    "tp+sp+selective": {
        "tensor_parallel": True,
        "sequence_parallel": True,
        "recompute": "selective",
    },
    "full": {"tensor_parallel": True, "recompute": "full"},
}
ACTIVATION_DROPOUT = 0.1
ACTIVATION_VOCAB = 64  # the head is outside the blocks: its size does not enter the count


@dataclass(frozen=True, kw_only=True)
class ActivationsConfig:
    seq: int = CompareConfig.seq
    """Sequence length s (every tp rank runs the whole micro-batch)."""
    batch: int = 8
    """Micro-batch b."""
    hidden: int = 64
    """Hidden size h."""
    heads: int = 4
    """Attention heads a."""
    layers: int = 2
    """Transformer layers."""
    tp: int = 2
    """Tensor-parallel degree t: the ranks started."""


def check_activations_config(cfg: ActivationsConfig) -> None:
    for name in ("seq", "batch", "hidden", "heads", "layers"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.tp < 2:
        raise ValueError(f"--tp must be at least 2 (the settings split across tp), got {cfg.tp}")
    if cfg.hidden % cfg.heads:
        raise ValueError(f"--heads {cfg.heads} must divide --hidden {cfg.hidden}")
    if cfg.heads % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide --heads {cfg.heads}")
    if cfg.seq % cfg.tp:
        raise ValueError(
            f"--tp {cfg.tp} must divide --seq {cfg.seq} (sequence parallelism splits it)"
        )


def activation_estimate_options(options: dict, tp_degree: int) -> dict:
    """``estimate_activations``'s options for a setting's GPT options."""
    return {
        "tp": tp_degree if options.get("tensor_parallel") else 1,
        "sequence_parallel": options.get("sequence_parallel", False),
        "recompute": options.get("recompute"),
    }


def _measure_activations_rank(rank: int, world_size: int, cfg: ActivationsConfig, out: str):
    """Every rank of the tp group measures each setting; rank 0 writes the largest per layer."""
    from .. import tensor_parallel as tp
    from ..models.gpt import GPT, GPTConfig

    layout = init_hybrid_parallel(1, world_size)
    tp.model_parallel_random_seed(7, layout)  # the dropouts draw from the tracker's streams
    gen = torch.Generator().manual_seed(0)  # the same tokens on every tp rank
    idx = torch.randint(0, ACTIVATION_VOCAB, (cfg.batch, cfg.seq), generator=gen)
    measured = []
    for options in ACTIVATION_SETTINGS.values():
        gpt_cfg = GPTConfig(
            vocab_size=ACTIVATION_VOCAB, block_size=cfg.seq, n_layer=cfg.layers,
            n_head=cfg.heads, n_embd=cfg.hidden, explicit_attention=True,
            dropout=ACTIVATION_DROPOUT, **options,
        )  # fmt: skip
        torch.manual_seed(0)
        measured.append(measure_activations(GPT(gpt_cfg, layout), idx).per_layer_bytes)
    values = torch.tensor(measured, dtype=torch.float64)
    dist.all_reduce(hand(values), op=dist.ReduceOp.MAX)  # the largest over ranks
    if rank == 0:
        Path(out).write_text(json.dumps(values.tolist()))


def run_activations(cfg: ActivationsConfig, progress: Callable[[str], None] = print) -> dict:
    """The five settings' activation bytes per layer per rank, estimated
    (``estimate_activations``, fp32 values) beside measured (``measure_activations`` on the
    built-in GPT with ``explicit_attention=True`` and dropout, on ``cfg.tp`` local gloo ranks
    forming one tp group)."""
    check_activations_config(cfg)
    started = time.perf_counter()
    progress(
        f"measuring {len(ACTIVATION_SETTINGS)} settings on {cfg.tp} gloo ranks (one tp group) ..."
    )
    with tempfile.TemporaryDirectory(prefix="zerokit-activations-") as tmp:
        out = os.path.join(tmp, "measured.json")
        spawn_local(_measure_activations_rank, cfg.tp, cfg, out)
        measured = json.loads(Path(out).read_text())
    progress(f"      done in {time.perf_counter() - started:.1f} s")
    rows = []
    for (name, options), got in zip(ACTIVATION_SETTINGS.items(), measured):
        estimate_options = activation_estimate_options(options, cfg.tp)
        want = estimate_activations(
            cfg.seq, cfg.batch, cfg.hidden, cfg.heads, cfg.layers,
            bytes_per_value=4, **estimate_options,
        )  # fmt: skip
        rows.append(
            {
                "setting": name,
                "estimate_options": estimate_options,
                "measured_per_layer": got,
                "estimated_per_layer": want.per_layer_bytes,
            }
        )
    return {
        "model": "built-in GPT",
        **asdict(cfg),
        "bytes_per_value": 4,
        "dropout": ACTIVATION_DROPOUT,
        "backend": "gloo",
        "rows": rows,
    }
