"""``zerokit compare``: train one model under torch DDP and every zerokit level, and print per
level the measured and estimated bytes per rank, the peak, the step time and the final loss.

The model contract (``--model pkg.module:factory``) is ``zerokit.tools.workload``'s.

Every rank trains on its slice of the global batch, so the final loss must be equal across
levels (a visible check of equivalence). Each level's memory is measured in fresh processes,
under torchrun too, so one level's memory never inflates or hides another's peak. The step
times and the final losses come from one run that trains every level side by side in the
same processes, one step of each per round, so every level meets the same machine (a shared
machine's load moves from one minute to the next).
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
from ..config import ShardingConfig
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
    shard_optimizer_over_replicas: bool = False
    """With ``sharding_degree``: the optimizer state sharded over the replicas too
    (``ShardingConfig.shard_optimizer_over_replicas``)."""


MEMORY_STEPS = 3
"""Steps a level's memory run trains: the first allocates the optimizer state, the second is a
steady step; one more to be sure the peak is a steady step's (``measure`` reads the last)."""


@dataclass
class _Runner:
    """One level's model, optimizer and scaler on this rank, and how it runs a step."""

    model: torch.nn.Module
    optimizer: object
    scaler: object
    autocast: object

    def forward_backward(self, work: Workload, x, y) -> torch.Tensor:
        with self.autocast:
            output = self.model(x)
        loss = work.loss_fn(output, y)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss

    def step(self) -> None:
        step_and_zero(self.optimizer, self.scaler)


def _build(level: str, model: torch.nn.Module, cfg: CompareConfig, device, groups: dict) -> _Runner:
    """Wrap ``model`` (already on ``device``) and an AdamW under ``level`` on this rank
    (``groups``: ``_groups``'s, for hybrid sharding)."""
    cuda = device.type == "cuda"
    low = {None: None, **PRECISIONS}[cfg.mixed_precision]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if level == "ddp":
        device_ids = [device.index] if cuda else None
        model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        scaler = torch.amp.GradScaler(device.type) if low == torch.float16 else None
    else:
        scaler = ShardedGradScaler() if low == torch.float16 else None
        model, optimizer, scaler = group_sharded_parallel(
            model, optimizer, level, scaler=scaler, mixed_precision=_policy(level, cfg), **groups
        )
    autocast = torch.autocast(device.type, dtype=low, enabled=level == "ddp" and low is not None)
    return _Runner(model, optimizer, scaler, autocast)


def _groups(cfg: CompareConfig, world_size: int) -> dict:
    """``group_sharded_parallel``'s process groups: with a sharding degree, shard inside groups
    of that many ranks and replicate across them; else none (all ranks)."""
    if cfg.sharding_degree == 1:
        return {}
    shards = cfg.sharding_degree
    layout = init_hybrid_parallel(world_size // shards, 1, sharding_degree=shards)
    config = ShardingConfig(shard_optimizer_over_replicas=cfg.shard_optimizer_over_replicas)
    return {"group": layout.sharding_group, "dp_group": layout.dp_group, "config": config}


def _policy(level: str, cfg: CompareConfig) -> MixedPrecision:
    low = {None: None, **PRECISIONS}[cfg.mixed_precision]
    return MixedPrecision(param_dtype=low) if level != "ddp" else MixedPrecision()


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _workload(cfg: CompareConfig, world_size: int) -> Workload:
    torch.manual_seed(0)  # every level starts from the same weights
    return build_workload(
        load_factory(cfg.model), batch=cfg.batch, seq=cfg.seq, per_rank=cfg.batch // world_size
    )


def _batch(work: Workload, cfg: CompareConfig, rank: int, world_size: int, step: int, device):
    per_rank = cfg.batch // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return (t[mine].to(device) for t in work.make_batch(step, cfg.batch))


def _measure_level(rank: int, world_size: int, level: str, cfg: CompareConfig, out_dir: str):
    """Build, wrap and train ``level`` alone in this fresh process for ``MEMORY_STEPS`` steps;
    rank 0 writes its bytes per category (measured and estimated) and its peak."""
    device = _device()
    peak = PeakMemory(device)
    peak.start()  # before the model exists: its state counts toward the peak
    work = _workload(cfg, world_size)
    model = work.model.to(device)
    shards = cfg.sharding_degree
    estimated = estimate(
        model,
        level,
        world_size,
        mixed_precision=_policy(level, cfg),
        sharding_degree=shards if level != "ddp" and shards > 1 else None,
        optimizer_over_replicas=cfg.shard_optimizer_over_replicas and level != "ddp",
    )
    runner = _build(level, model, cfg, device, _groups(cfg, world_size))
    steps = min(cfg.steps, MEMORY_STEPS)
    for step in range(steps):
        x, y = _batch(work, cfg, rank, world_size, step, device)
        runner.forward_backward(work, x, y)
        if step == steps - 1:  # what a rank holds with gradients present
            measured = measure(runner.model, runner.optimizer)
        runner.step()
    values = torch.tensor(
        [measured.params, measured.grads, measured.optimizer, peak.read()],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(hand(values), op=dist.ReduceOp.MAX)  # the largest over ranks
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
        }
        Path(out_dir, f"{level}.json").write_text(json.dumps(row))


def _train_interleaved(rank: int, world_size: int, cfg: CompareConfig, out_dir: str) -> None:
    """Train every level side by side in these processes for ``cfg.steps`` steps, one step of
    each per round, and time each step; rank 0 writes each level's step times (the slowest
    rank's) and final loss.

    Note: the levels take turns within a round, in an order that rotates each round, so a level
    never runs in a quieter or busier stretch of a shared machine than the others, nor always
    right after the same one.
    """
    device, groups = _device(), _groups(cfg, world_size)
    work = _workload(cfg, world_size)  # its batches and loss; each level its own model
    runners = {
        level: _build(level, _workload(cfg, world_size).model.to(device), cfg, device, groups)
        for level in LEVELS
    }
    times = {level: [] for level in LEVELS}
    losses = {}
    for step in range(cfg.steps):
        x, y = _batch(work, cfg, rank, world_size, step, device)
        for level in rotated(LEVELS, step):
            dist.barrier()  # every rank starts the level's step together
            start = time.perf_counter()
            losses[level] = runners[level].forward_backward(work, x, y).detach()
            runners[level].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[level].append(time.perf_counter() - start)
    values = torch.tensor([times[level] for level in LEVELS], dtype=torch.float64, device=device)
    dist.all_reduce(hand(values), op=dist.ReduceOp.MAX)  # a step takes its slowest rank's time
    final = torch.stack([losses[level].double() for level in LEVELS])
    dist.all_reduce(hand(final))
    if rank == 0:
        rows = {
            level: {"times": t, "final_loss": loss / world_size}
            for level, t, loss in zip(LEVELS, values.tolist(), final.tolist())
        }
        Path(out_dir, "interleaved.json").write_text(json.dumps(rows))


def rotated(levels, round_index: int) -> list:
    """``levels`` starting at the ``round_index``-th (modulo their number): the order of a round."""
    k = round_index % len(levels)
    return list(levels[k:]) + list(levels[:k])


def step_time_summary(times: list[float]) -> dict:
    """One level's step time over the interleaved rounds: the median, and the middle half of
    the rounds (the 25th to 75th percentile) as its spread. The first round is left out when
    there are others: it allocates the optimizer state and warms the allocator."""
    timed = times[1:] or times
    if len(timed) == 1:
        low = high = timed[0]
    else:
        low, _, high = statistics.quantiles(timed, n=4, method="inclusive")
    return {"median": statistics.median(timed), "low": low, "high": high, "rounds": len(timed)}


def _row(memory: dict, interleaved: dict) -> dict:
    timing = step_time_summary(interleaved["times"])
    return {
        **memory,
        "step_time_s": timing["median"],
        "step_time_spread_s": [timing["low"], timing["high"]],
        "step_time_rounds": timing["rounds"],
        "final_loss": interleaved["final_loss"],
    }


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
        "memory_steps": min(cfg.steps, MEMORY_STEPS),
        "batch": cfg.batch,
        "rows": rows,
    }


def run_compare(cfg: CompareConfig, progress: Callable[[str], None] = print) -> dict:
    """Measure every level's memory (fresh ranks for each, so peaks don't mix), then train the
    levels side by side, interleaved, for their step times and final losses (in the last
    level's ranks, once its peak is read); return the report.

    CPU/gloo by default; CUDA/NCCL, one GPU per rank, when there are ``nproc`` GPUs.
    """
    check_config(cfg)
    backend = local_backend(cfg.nproc)
    with tempfile.TemporaryDirectory(prefix="zerokit-compare-") as out_dir:
        for job, level, started in _jobs(cfg, backend, out_dir, progress):
            spawn_local(job, cfg.nproc, level, cfg, out_dir, backend=backend)
            _progress_done(progress, level, started)
        rows = _rows(out_dir)
    return _report(cfg, backend, rows)


def _jobs(cfg: CompareConfig, backend: str, out_dir: str, progress):
    """The runs of a compare, in order, as (function, its level, start time), each announced
    through ``progress``: one memory run per level, the last one going on to the interleaved
    run in the same processes (after its peak is read: one start of the ranks fewer)."""
    for i, level in enumerate(LEVELS, 1):
        last = i == len(LEVELS)
        progress(
            f"[{i}/{len(LEVELS)}] {level:<7} memory over {min(cfg.steps, MEMORY_STEPS)} steps"
            + (f", then every level side by side, {cfg.steps} rounds," if last else "")
            + f" on {cfg.nproc} {backend} ranks ..."
        )
        yield (_measure_then_interleave if last else _measure_level), level, time.perf_counter()


def _measure_then_interleave(rank: int, world_size: int, level: str, cfg, out_dir: str) -> None:
    """``level``'s memory run, then every level's interleaved run, in these processes.

    Note: the memory run comes first, so its peak is read in a process that has held nothing
    else, as a process of its own would; what it leaves resident only moves the timing run's
    memory, not its time."""
    _measure_level(rank, world_size, level, cfg, out_dir)
    _train_interleaved(rank, world_size, cfg, out_dir)


def _progress_done(progress, level: str, started: float) -> None:
    progress(f"      {level:<7} done in {time.perf_counter() - started:.1f} s")


def _rows(out_dir: str) -> list[dict]:
    interleaved = json.loads(Path(out_dir, "interleaved.json").read_text())
    return [
        _row(json.loads(Path(out_dir, f"{level}.json").read_text()), interleaved[level])
        for level in LEVELS
    ]


def run_under_torchrun(cfg: CompareConfig, progress: Callable[[str], None] = print) -> dict:
    """Under torchrun: every torchrun rank starts one fresh process per level (the last going
    on to the interleaved run), and those processes form that level's process group, so each
    level's peak is measured from a clean process exactly as with ``--nproc``. Returns the
    report on rank 0, {} elsewhere.

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
            quiet = progress if rank == 0 else (lambda _: None)
            for job, level, started in _jobs(cfg, backend, out_dir, quiet):
                child = mp.get_context("spawn").Process(
                    target=_level_process,
                    args=(rank, world_size, job, level, cfg, out_dir, host, port[0], backend),
                )
                child.start()
                child.join()
                if child.exitcode != 0:
                    raise RuntimeError(
                        f"level {level}: rank {rank}'s process exited with code {child.exitcode}"
                    )
                _progress_done(quiet, level, started)
            if rank == 0:
                rows = _rows(out_dir)
        dist.barrier()  # rank 0's store serves until every rank is done
    finally:
        if own_group:
            dist.destroy_process_group()
    return _report(cfg, backend, rows) if rank == 0 else {}


def _level_process(rank, world_size, job, level, cfg, out_dir, host, port, backend) -> None:
    """One rank of one level's run, in a fresh process started by a torchrun rank."""
    _exit_with_parent()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = dist.PrefixStore(f"zerokit-compare/{level}", dist.TCPStore(host, port))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        job(rank, world_size, level, cfg, out_dir)
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
