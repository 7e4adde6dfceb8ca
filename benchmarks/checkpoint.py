"""Checkpoint save and load time and size: zerokit's sharded safetensors checkpoints (same
level, and resharded to another level) beside torch.distributed.checkpoint (DCP) with FSDP2
and a rank-0 torch.save of DDP's full state, side by side in one run on gloo CPU ranks.

    python benchmarks/checkpoint.py            # 27M-parameter GPT + AdamW state, 2 ranks

Then ``async_save``: how long the call blocks training (state copied to host memory, ranks
agreed) against a synchronous ``save`` of the same state, and when its checkpoint is in place;
the process's first ``async_save`` (no ``prewarm_async_save``) on a row of its own.
Then export: ``consolidate`` to a Hugging Face set of 8 files by one writer (rank 0) and by
every rank (each writes whole files of its own), and ``load_pretrained`` from it (every rank,
``'p_g_os'``), in bytes/s beside a plain write (64 MiB blocks, fsync; by one writer, and by
every rank writing its share at once) and a plain read (``pread``, each rank its share) of
the same bytes on the same disk; and the files a
``save(format="dcp")`` writes (each rank its own ``__<rank>_0.distcp``).

    python benchmarks/checkpoint.py --sections export   # one section: save, async, export

Then interference: what an ``async_save``'s background write costs the training steps that
run beside it. A stack of ``--linear-layers`` Linear(``--width``) layers at ``'os_g'`` with
AdamW: the median step with no save, against the median step while an ``async_save`` writes
(steps run until every rank's future is done; the quiet steps are timed before and after
the saves), their ratio, how long each call blocked
(the process's first save, with and without ``prewarm_async_save``, and the later ones) beside
a synchronous save, and the host memory the staging holds.

    python benchmarks/checkpoint.py --sections interference --nproc 2
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import zerokit
from zerokit.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from zerokit.tools.launch import spawn_local


def _stepped(runner: str, base, x, y):
    """A model and optimizer of ``runner`` after one step (so the optimizer has state)."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if runner == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif runner == "ddp":
        model = DistributedDataParallel(model)
    else:
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, runner)
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, args) -> None:
    cfg = GPTConfig(vocab_size=4096, block_size=128, n_layer=args.layers, n_head=8, n_embd=512)
    torch.manual_seed(0)
    base = GPT(cfg)
    x, y = synthetic_batch(cfg.vocab_size, 2, 128, seed=rank)
    root = tempfile.mkdtemp(prefix="zk-bench-") if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)  # benchmark plumbing only; zerokit never pickles
    root = holder[0]
    rows, blocked, export = [], [], []
    if "export" in args.sections:
        export = _export_rows(root, base, x, y, args.repeats)
    if "async" in args.sections:
        blocked = _async_rows(root, base, x, y, args.repeats)

    def zerokit_case(save_level: str, load_level: str):
        model, opt = _stepped(save_level, base, x, y)
        target, target_opt = _stepped(load_level, base, x, y)
        path = os.path.join(root, f"zk-{save_level}")
        return (
            lambda: zerokit.checkpoint.save(path, model, opt),
            lambda: zerokit.checkpoint.load(path, target, target_opt),
            path,
        )

    def dcp_case():
        model, opt = _stepped("fsdp2", base, x, y)
        path = os.path.join(root, "dcp")

        def save():
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load():
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )

        return save, load, path

    def torch_save_case():
        model, opt = _stepped("ddp", base, x, y)
        path = os.path.join(root, "full.pt")

        def save():
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, path)

        def load():
            state = torch.load(path, weights_only=True)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])

        return save, load, path

    cases = {
        "zerokit os -> os": lambda: zerokit_case("os", "os"),
        "zerokit p_g_os -> p_g_os": lambda: zerokit_case("p_g_os", "p_g_os"),
        "zerokit p_g_os -> os": lambda: zerokit_case("p_g_os", "os"),
        "DCP + FSDP2": dcp_case,
        "torch.save (rank 0, DDP)": torch_save_case,
    }
    interference = _interference_rows(root, args) if "interference" in args.sections else []
    for name, make in cases.items() if "save" in args.sections.split(",") else ():
        save, load, path = make()
        saves, loads = [], []
        for _ in range(args.repeats):
            saves.append(_timed(save))
            loads.append(_timed(load))
        rows.append((name, statistics.median(saves), statistics.median(loads), _dir_bytes(path)))
    if rank == 0:
        n = sum(p.numel() for p in base.parameters())
        print(f"GPT {n / 1e6:.1f}M params + AdamW state, {world_size} gloo ranks, {root}")
        if rows:
            print(f"{'checkpoint':<28}{'save s':>8}{'load s':>8}{'MiB':>8}")
        for name, s, ld, size in rows:
            print(f"{name:<28}{s:>8.3f}{ld:>8.3f}{size / 2**20:>8.1f}")
        for line in export:
            print(line)
        if blocked:
            print(
                f"\n{'async_save':<34}{'save s':>8}{'blocked s':>10}{'cpu s':>7}"
                f"{'in place s':>11}{'ratio':>7}"
            )
        for name, sync, block, cpu, total in blocked:
            print(
                f"{name:<34}{sync:>8.3f}{block:>10.3f}{cpu:>7.3f}{total:>11.3f}{block / sync:>7.2f}"
            )
        for line in interference:
            print(line)
        shutil.rmtree(root, ignore_errors=True)


def _plain_write(path: str, nbytes: int) -> float:
    block = _BLOCK
    start = time.perf_counter()
    with open(path, "wb") as f:
        for at in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - at)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


_BLOCK = bytearray(64 << 20)  # dd's buffer, allocated once


def _plain_read(paths: list[str], share: int, rank: int, world: int) -> float:
    """Read ``share`` bytes, this rank's part of the files, as a loader of its shards would."""
    sizes = [os.path.getsize(p) for p in paths]
    lo = sum(sizes) * rank // world
    buffer = _BLOCK
    start, done = time.perf_counter(), 0
    for path, size in zip(paths, sizes):
        with open(path, "rb") as f:
            while done < share and lo < size:
                n = os.preadv(
                    f.fileno(),
                    [memoryview(buffer)[: min(len(buffer), share - done, size - lo)]],
                    lo,
                )
                done, lo = done + n, lo + n
        lo = max(0, lo - size)
    return time.perf_counter() - start


def _export_rows(root: str, base, x, y, repeats: int) -> list[str]:
    """Consolidate to a set of 8 files by one writer (rank 0) and by every rank (each writes
    whole files of its own), and load_pretrained (every rank), against plain writes and reads
    of the same bytes, alternating, medians of ``repeats``; files in the page cache for all."""
    model, opt = _stepped("os", base, x, y)
    path, hf = os.path.join(root, "export"), os.path.join(root, "export-hf")
    zerokit.checkpoint.save(path, model, opt)
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    target, _ = _stepped("p_g_os", base, x, y)
    times: dict[str, list[float]] = {}
    part = nbytes // world  # each rank's share, read by load_pretrained and by the plain read
    shard = nbytes // 8 + 1  # 8 files for the writers to share
    consolidate, one = zerokit.checkpoint.consolidate, os.path.join(root, "export-one")
    plain = os.path.join(root, f"plain-{rank}")  # the same bytes, each rank its share

    def by_all(verify: bool) -> None:
        consolidate(path, hf, shard, verify=verify, group=dist.group.WORLD)

    for _ in range(repeats):
        for verify in (True, False):
            if rank == 0:
                start = time.perf_counter()
                consolidate(path, one, max_shard_size=shard, verify=verify)
                times.setdefault(f"one {verify}", []).append(time.perf_counter() - start)
            times.setdefault(f"all {verify}", []).append(_timed(lambda v=verify: by_all(v)))
        if rank == 0:
            times.setdefault("write", []).append(_plain_write(os.path.join(root, "plain"), nbytes))
        times.setdefault("write all", []).append(_timed(lambda: _plain_write(plain, part)))
        times.setdefault("in", []).append(
            _timed(lambda: zerokit.checkpoint.load_pretrained(target, hf))
        )
        files = sorted(os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors"))
        times.setdefault("read", []).append(
            _timed(lambda files=files: _plain_read(files, part, rank, world))
        )
    dcp = _dcp_files(root, model, opt)
    if rank != 0:
        return []
    return _export_lines({k: statistics.median(v) for k, v in times.items()}, nbytes, world, dcp)


def _export_lines(t: dict, nbytes: int, world: int, dcp: str) -> list[str]:
    mb = lambda seconds: nbytes / seconds / 1e6  # noqa: E731
    lines = [
        f"\nexport of {nbytes / 2**20:.1f} MiB (8 files){'':<11}{'MB/s':>8}{'plain MB/s':>12}"
        f"{'ratio':>7}{'vs 1 writer':>13}"
    ]
    write, write_all = t["write"], t["write all"]
    for verify, label in ((True, "consolidate"), (False, "consolidate --no-verify")):
        one, every = t[f"one {verify}"], t[f"all {verify}"]
        lines.append(
            f"{label + ', 1 writer':<46}{mb(one):>8.0f}{mb(write):>12.0f}"
            f"{write / one:>7.2f}{1:>13.2f}"
        )
        lines.append(
            f"{label + f', {world} writers (ranks)':<46}{mb(every):>8.0f}{mb(write_all):>12.0f}"
            f"{write_all / every:>7.2f}{one / every:>13.2f}"
        )
    lines.append(
        f"{f'plain write, {world} writers against 1':<46}{mb(write_all):>8.0f}{mb(write):>12.0f}"
        f"{write / write_all:>7.2f}"
    )
    share = nbytes / world
    lines.append(
        f"{'load_pretrained (per rank)':<46}{share / t['in'] / 1e6:>8.0f}"
        f"{share / t['read'] / 1e6:>12.0f}{t['read'] / t['in']:>7.2f}"
    )
    return [*lines, dcp]


def _dcp_files(root: str, model, opt) -> str:
    """save(format="dcp"): who wrote which bytes (each rank its own ``__<rank>_0.distcp``)."""
    path = os.path.join(root, "export-dcp")
    zerokit.checkpoint.save(path, model, opt, format="dcp")
    sizes = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))}
    return "save(format='dcp') files: " + ", ".join(
        f"{n} {size / 2**20:.1f} MiB" for n, size in sizes.items()
    )


def _async_rows(root: str, base, x, y, repeats: int) -> list[tuple]:
    """Per level and format: the synchronous save, the time ``async_save`` blocks the caller
    and the CPU time the calling thread spent in it (page faults included: on a machine whose
    cores are all taken it is the steadier figure), and the time until its checkpoint is in
    place (medians; the slowest rank each time). The process's first ``async_save`` (of the
    first level) gets a row of its own."""
    rows = []
    for level, fmt in (("os", "zerokit"), ("p_g_os", "zerokit"), ("os", "dcp")):
        model, opt = _stepped(level, base, x, y)
        path = os.path.join(root, f"async-{level}-{fmt}")
        runs = []  # (blocked s, blocked cpu s, in place s) per save
        syncs = [_timed(lambda m=model, o=opt, p=path, f=fmt: zerokit.checkpoint.save(p, m, o, format=f))
                 for _ in range(repeats)]  # fmt: skip
        for _ in range(repeats):
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            future = zerokit.checkpoint.async_save(path, model, opt, format=fmt)
            blocked, cpu = time.perf_counter() - start, time.thread_time() - cpu
            future.result()
            took = torch.tensor([blocked, cpu, time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            runs.append(took.tolist())
        name, sync = f"zerokit {level} ({fmt})", statistics.median(syncs)
        if not rows and repeats > 1:  # the process's first async_save, apart
            rows.append((name + ", first", sync, *runs[0]))
            name, runs = name + ", later", runs[1:]
        rows.append((name, sync, *(statistics.median(column) for column in zip(*runs))))
    return rows


def _interference_rows(root: str, args) -> list[str]:
    """Step time beside an async_save's write against steps with none, side by side."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.linear_layers)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os_g")
    x = torch.randn(16, args.width)

    def step(writing) -> tuple[float, bool]:
        """One step, timed; and whether any rank's save is still writing after it (each
        rank runs the same steps: a step holds collectives)."""
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        took = time.perf_counter() - start
        busy = torch.tensor([0 if writing is None or writing.done() else 1])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        return took, bool(busy.item())

    for _ in range(3):
        step(None)
    quiet = [step(None)[0] for _ in range(args.steps)]
    path = os.path.join(root, "interference")
    beside, blocks, warmed = [], [], 0.0
    if args.prewarm:
        warmed = _timed(lambda: zerokit.checkpoint.prewarm_async_save(model, opt))
    for _ in range(args.repeats + 1):  # the process's first async_save, then the later ones
        dist.barrier()
        start = time.perf_counter()
        future = zerokit.checkpoint.async_save(path, model, opt)
        blocks.append(time.perf_counter() - start)
        busy = True
        while busy:
            took, busy = step(future)
            beside.append(took)
        future.result()
    quiet += [step(None)[0] for _ in range(args.steps)]  # before and after: the load drifts
    sync = statistics.median(
        [_timed(lambda: zerokit.checkpoint.save(path, model, opt)) for _ in range(args.repeats)]
    )
    staged = zerokit.checkpoint.async_save_staging_bytes()
    q, b = statistics.median(quiet), statistics.median(beside)
    first, later = blocks[0], statistics.median(blocks[1:])
    return [
        f"\ninterference: {args.linear_layers} x Linear({args.width}) 'os_g', AdamW, "
        f"{dist.get_world_size()} ranks, rank 0's view",
        f"{'step s, no save':<34}{q:>8.3f}   ({len(quiet)} steps)",
        f"{'step s, beside an async write':<34}{b:>8.3f}   ({len(beside)} steps)",
        f"{'ratio (target <= 1.10)':<34}{b / q:>8.2f}",
        f"{'sync save s':<34}{sync:>8.3f}",
        f"{'first async_save blocked s':<34}{first:>8.3f}   ({first / sync:.2f} x sync)",
        f"{'later async_save blocked s':<34}{later:>8.3f}   ({later / sync:.2f} x sync)",
        f"{'prewarm_async_save s':<34}{warmed:>8.3f}   "
        f"({'before the first save' if args.prewarm else 'not asked: --prewarm 1'})",
        f"{'staging host memory MiB':<34}{staged / 2**20:>8.1f}",
    ]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start")
    p.add_argument("--layers", type=int, default=8, help="GPT blocks (8: 27.3M parameters)")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads timed (median)")
    p.add_argument(
        "--sections", default="save,async,export,interference", help="which to run, of these"
    )
    p.add_argument("--linear-layers", type=int, default=24, help="interference: layers")
    p.add_argument("--width", type=int, default=1024, help="interference: layer width")
    p.add_argument("--steps", type=int, default=8, help="interference: quiet steps timed")
    p.add_argument(
        "--prewarm", type=int, default=0, help="interference: 1 = prewarm_async_save first"
    )
    args = p.parse_args()
    spawn_local(worker, args.nproc, args)


if __name__ == "__main__":
    main()
